"""
Tests for L{llmgw.untrusted}: client strings quoted with a bound, JSON
bodies parsed with bounded depth and no repeated top-level key.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from llmgw.untrusted import CLIP, MAX_JSON_DEPTH, JSONInputError, clip, load_json, too_deep


def depth(value: Any) -> int:
    if isinstance(value, list):
        return 1 + max((depth(v) for v in value), default=0)
    if isinstance(value, dict):
        return 1 + max((depth(v) for v in value.values()), default=0)
    return 0


# Strings full of what a scan could mistake for structure.
_tricky = st.text(alphabet='[]{}"\\ab\u00e9\n', max_size=8)
_json = st.recursive(
    st.none() | st.booleans() | st.integers() | _tricky,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(_tricky, children, max_size=3),
    max_leaves=40,
)


class ClipTests(SynchronousTestCase):
    def test_short_strings_quoted_whole(self) -> None:
        """
        A string within the bound comes back as its C{repr}, control
        characters escaped.
        """
        self.assertEqual(clip("demo"), "'demo'")
        self.assertEqual(clip("a\r\nInjected: 1"), "'a\\r\\nInjected: 1'")
        self.assertEqual(clip(b"/v1/x"), "'/v1/x'")

    def test_long_strings_cut_with_their_length(self) -> None:
        """
        Past the bound only the first L{CLIP} characters are quoted, with an
        ellipsis and the full length, however long the string is.
        """
        for value in ("m" * 1_000_000, b"m" * 1_000_000):
            out = clip(value)
            self.assertLess(len(out), CLIP + 40)
            self.assertTrue(out.startswith("'" + "m" * CLIP + "'\u2026"), out)
            self.assertIn("1000000", out)
        self.assertLess(len(clip("\x00" * 10_000)), 4 * CLIP + 40)


class DepthTests(SynchronousTestCase):
    @given(_json, st.integers(min_value=0, max_value=6))
    @settings(max_examples=300)
    def test_agrees_with_the_value(self, value: Any, limit: int) -> None:
        """
        For any JSON text, L{too_deep} says whether its arrays and objects
        nest deeper than the limit, brackets inside strings (escaped quotes
        and backslashes included) not counted.
        """
        for text in (json.dumps(value), json.dumps(value, ensure_ascii=False, indent=1)):
            self.assertEqual(too_deep(text.encode(), limit), depth(value) > limit, text)

    def test_unclosed_brackets_count(self) -> None:
        """
        Brackets that are never closed count: C{json.loads} recurses into
        them before it finds the text truncated.
        """
        self.assertTrue(too_deep(b"[" * 65))
        self.assertTrue(too_deep(b'{"a":' * 65))
        self.assertFalse(too_deep(b"[" * 64))

    def test_linear(self) -> None:
        """
        The scan of a large body is linear: over 8 MiB of brackets or of
        strings, its one Python-level loop visits each structural byte once
        at most (counted, not timed; the rest are single C passes).
        """
        from itertools import accumulate

        from llmgw import untrusted

        visited: list[int] = []

        def counting(block: bytes) -> Any:
            visited.append(len(block))
            return accumulate(block)

        self.patch(untrusted, "accumulate", counting)
        for body in (b"[" + b"[]," * 2_000_000 + b"[]]", json.dumps(["ab\\\"[{" * 10] * 100_000).encode()):
            del visited[:]
            self.assertFalse(too_deep(body))
            self.assertTrue(visited)
            self.assertLessEqual(sum(visited), len(body))


class LoadTests(SynchronousTestCase):
    def test_deep_refused_before_parsing(self) -> None:
        """
        100,000 nested levels are refused with the reason, no
        C{RecursionError}; 64 levels are parsed.
        """
        for body in (b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 100_000 + b"1" + b"}" * 100_000):
            e = self.assertRaises(JSONInputError, load_json, body)
            self.assertEqual(e.code, "json_too_deep")
            self.assertIn(f"more than {MAX_JSON_DEPTH} levels deep", str(e))
        self.assertEqual(depth(load_json(b"[" * 64 + b"]" * 64)), 64)

    def test_repeated_top_level_key(self) -> None:
        """
        A top-level key that C{unique} covers, given twice (spelled the same
        or with escapes), is refused and named; a repeat inside a nested
        object, or of a key C{unique} does not cover, is not.
        """
        for body in (b'{"model": "a", "model": "b"}', b'{"model": "a", "mod\\u0065l": "b"}'):
            e = self.assertRaises(JSONInputError, load_json, body, unique=("model",))
            self.assertEqual(e.code, "duplicate_key")
            self.assertIn("'model'", str(e))
        value = load_json(b'{"model": "a", "x": {"model": 1, "model": 2}, "y": 1, "y": 2}', unique=("model",))
        self.assertEqual(value, {"model": "a", "x": {"model": 2}, "y": 2})
        e = self.assertRaises(JSONInputError, load_json, b'{"y": 1, "y": 2}', unique=None)
        self.assertIn("'y'", str(e))
        self.assertEqual(load_json(b'[{"a": 1, "a": 2}]', unique=None), [{"a": 2}])

    def test_malformed(self) -> None:
        """
        Text that is not JSON, or not UTF-8, is refused as invalid JSON.
        """
        for body in (b'{"model": "a"', b"\xff\xfe{}", b"nope", b""):
            e = self.assertRaises(JSONInputError, load_json, body)
            self.assertEqual(e.code, "invalid_json")
            self.assertIn("not valid JSON", str(e))

    def test_byte_order_mark(self) -> None:
        """
        A body starting with a UTF-8 byte order mark is refused as not valid
        JSON, saying so (RFC 8259: JSON sent over a network has none, and
        the body is forwarded as it came); a mark inside a string is text.
        """
        bom = b"\xef\xbb\xbf"
        for body in (bom + b'{"model": "m"}', bom + bom + b"{}", bom + b"[]"):
            for unique in ((), None, ("model",)):
                with self.assertRaises(JSONInputError) as refused:
                    load_json(body, unique=unique)
                self.assertEqual(refused.exception.code, "invalid_json")
                self.assertIn("byte order mark", str(refused.exception))
        self.assertEqual(load_json(b'{"model": "' + bom + b'"}'), {"model": "\ufeff"})

    def test_nan_and_infinity(self) -> None:
        """
        C{NaN}, C{Infinity} and C{-Infinity}, which Python's C{json} reads
        as numbers, are refused as not valid JSON, naming the one found,
        at the top level or nested, whichever keys are to be unique; the
        strings C{"NaN"} and numbers with exponents are still read.
        """
        for name in ("NaN", "Infinity", "-Infinity"):
            for body in (name, f'{{"model": "m", "t": {name}}}', f'{{"x": [1, {{"y": {name}}}]}}'):
                for unique in ((), None, ("model",)):
                    with self.assertRaises(JSONInputError) as refused:
                        load_json(body.encode(), unique=unique)
                    self.assertEqual(refused.exception.code, "invalid_json")
                    self.assertIn(f"{name} is not a JSON value", str(refused.exception))
        self.assertEqual(load_json(b'{"a": "NaN", "b": 1e5}'), {"a": "NaN", "b": 1e5})


class SameAsJSONTests(SynchronousTestCase):
    @settings(max_examples=300, deadline=None)
    @given(
        st.one_of(
            _json.map(json.dumps),
            st.text(alphabet=' \t\n\r[]{}",:0123456789.-eEtrufalsn\\', max_size=24),
            st.tuples(st.sampled_from(["", " ", "\n\t"]), _json.map(json.dumps),
                      st.sampled_from(["", " ", "\r\n", " x", ",1"])).map("".join),
        )
    )
    def test_value_or_refusal_as_json_loads(self, text: str) -> None:
        """
        What load_json makes of a body (with no key to check) is what
        C{json.loads} makes of it: the same value, or a refusal where it
        raises, with its message.
        """
        raw = text.encode()
        try:
            expected = json.loads(text)
        except ValueError as e:
            err = self.assertRaises(JSONInputError, load_json, raw)
            self.assertEqual(err.code, "invalid_json")
            self.assertEqual(str(err), f"the body is not valid JSON: {e}")
        else:
            self.assertEqual(load_json(raw), expected)
