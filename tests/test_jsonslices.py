"""
Tests for L{llmgw.jsonslices} and the gateway's sliced parse of large
bodies (L{llmgw.gateway.bigbody}).
"""

from __future__ import annotations

import json
from typing import Any

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from llmgw.gateway.bigbody import KEPT_CHARS, KEPT_ITEMS, SlicedParses, sliced
from llmgw.gateway.policy import PolicyConfig, affinity_key
from llmgw.gateway.resource import KEPT_KEYS
from llmgw.jsonslices import PIECE, SLICE_TOKENS, load_json_sliced, run_sliced
from llmgw.untrusted import JSONInputError, load_json

CASES = [
    b'{"model":"m"}', b' {"a": [1, 2, {"b": null}], "c": "x\\u00e9"} ', b"[]", b"{}", b"[[],{}]", b"1",
    b'"s"', b"", b'{"model":"a","model":"b"}', b'{"a":1,"a":2}', b'{"x":{"a":1,"a":2}}', b'{"a":NaN}',
    b"[Infinity]", b"\xef\xbb\xbf{}", b'{"a":1,}', b"[1,]", b"[1 2]", b'{"a" 1}', b"{1:2}", b'{"a":1}x',
    b"\xff", b"[" * 64 + b"]" * 64, b"[" * 65 + b"]" * 65, b'{"a":"b\nc"}', b"[-0.5e3, true, false, null]",
    b'{"mod\\u0065l":"x","model":"y"}', b"[1,2", b'{"a":1', b"[-Infinity]", b'{"a":[]  ,  "b":{} }',
]


def outcome(f: Any) -> tuple[str, Any]:
    try:
        return "value", f()
    except JSONInputError as e:
        return "refused", e.code


class SlicedTests(SynchronousTestCase):
    def test_same_as_load_json(self) -> None:
        """
        The sliced parse gives the value C{load_json} gives, and refuses what
        it refuses with the same code: bad JSON, NaN and Infinity, a byte
        order mark, not UTF-8, too deep, a repeated unique key.
        """
        for raw in CASES:
            for unique in (("model",), None, ()):
                self.assertEqual(
                    outcome(lambda r=raw, u=unique: run_sliced(load_json_sliced(r, unique=u))),
                    outcome(lambda r=raw, u=unique: load_json(r, unique=u)),
                    raw,
                )

    def test_slices(self) -> None:
        """
        A body of many small keys is parsed over many slices of at most
        L{SLICE_TOKENS} tokens each.
        """
        n = 10 * SLICE_TOKENS
        raw = json.dumps({"model": "m", **{f"k{i}": i for i in range(n)}}).encode()
        gen = load_json_sliced(raw, unique=("model",))
        slices = 0
        while True:
            try:
                next(gen)
            except StopIteration as stop:
                value = stop.value
                break
            slices += 1
        self.assertGreaterEqual(slices, n // SLICE_TOKENS)
        self.assertEqual(value, json.loads(raw))

    def test_keep(self) -> None:
        """
        With C{keep}, only those top-level keys are in the value; the others
        are still checked (a repeated C{model} nested in a left-out value is
        refused as invalid JSON would be, a repeated top-level one refused).
        """
        raw = b'{"model":"m","x":[1,{"a":2}],"messages":[{"role":"user"}],"n":3}'
        value = run_sliced(load_json_sliced(raw, unique=("model",), keep=("model", "messages")))
        self.assertEqual(value, {"model": "m", "messages": [{"role": "user"}]})
        with self.assertRaises(JSONInputError) as e:
            run_sliced(load_json_sliced(b'{"model":"m","x":[1,NaN]}', keep=("model",)))
        self.assertEqual(e.exception.code, "invalid_json")
        with self.assertRaises(JSONInputError) as e:
            run_sliced(load_json_sliced(b'{"model":[],"x":1,"model":"m"}', unique=("model",), keep=("x",)))
        self.assertEqual(e.exception.code, "duplicate_key")


class SlicedParsesTests(SynchronousTestCase):
    def test_one_slice_a_turn(self) -> None:
        """
        A body is parsed one slice per reactor turn, one body at a time, and
        its value handed over at the end.
        """
        clock = Clock()
        scheduled: list[float] = []
        call_later = clock.callLater

        def counted(delay: float, f: Any, *a: Any) -> Any:
            scheduled.append(delay)
            return call_later(delay, f, *a)

        clock.callLater = counted  # type: ignore[method-assign]
        parses = SlicedParses(clock)
        raw = json.dumps({"model": "m", **{f"k{i}": i for i in range(3 * SLICE_TOKENS)}}).encode()
        got: list[Any] = []
        parses.parse(raw, got.append, got.append)
        parses.parse(b'{"model":"second"}', got.append, got.append)
        self.assertEqual(got, [])
        clock.advance(0)
        # Each slice is a call of its own, so the reactor's I/O runs between.
        self.assertGreaterEqual(len(scheduled), 4)
        self.assertEqual(got[0], json.loads(raw))
        self.assertEqual(got[1], {"model": "second"})

    def test_bounded_queue(self) -> None:
        """
        Past its byte budget the queue takes no more bodies; a cancelled one
        is never answered.
        """
        clock = Clock()
        parses = SlicedParses(clock, max_waiting_bytes=100)
        got: list[Any] = []
        cancel = parses.parse(b"[" + b"1," * 10 + b"1]", got.append, got.append)
        assert cancel is not None
        self.assertIsNotNone(parses.parse(b"[" + b"1," * 40 + b"1]", got.append, got.append))
        self.assertIsNone(parses.parse(b"[" + b"1," * 40 + b"1]", got.append, got.append))
        cancel()
        for _ in range(10):
            clock.advance(0)
        self.assertEqual(got, [[1] * 41])


def slices_of(gen: Any) -> tuple[int, Any]:
    """
    The number of slices C{gen} took and its value (or its refusal's code).
    """
    slices = 0
    while True:
        try:
            next(gen)
        except StopIteration as stop:
            return slices, stop.value
        except JSONInputError as e:
            return slices, ("refused", e.code)
        slices += 1


#: Adversarial bodies of about 512 KiB, one per shape a client may send.
_SIZE = 512 * 1024
ADVERSARIAL = {
    "small keys": b'{"model":"m",' + b",".join(b'"k%d":1' % i for i in range(_SIZE // 9)) + b"}",
    "small messages": b'{"model":"m","messages":[' + b",".join([b'{"role":"user","content":"x"}'] * (_SIZE // 30))
    + b"]}",
    "deep nesting": b'{"model":"m","messages":[' + b",".join([b"[" * 60 + b"]" * 60] * (_SIZE // 121)) + b"]}",
    "long string": b'{"model":"m","prompt":"' + b"a" * _SIZE + b'"}',
    "many escapes": b'{"model":"m","prompt":"' + b"\\n\\u00e9\\\"\\\\" * (_SIZE // 12) + b'"}',
    "surrogate pairs": b'{"model":"m","prompt":"' + b"\\ud83d\\ude00" * (_SIZE // 12) + b'"}',
    "small items": b'{"model":"m","prompt":[' + b",".join([b"7"] * (_SIZE // 2)) + b"]}",
    "huge float": b'{"model":"m","x":0.' + b"1" * _SIZE + b"}",
    "huge integer": b'{"model":"m","x":' + b"1" * _SIZE + b"}",
    "blanks": b'{"model":"m","x":1' + b" " * _SIZE + b"}",
    "long key": b'{"model":"m","' + b"k" * _SIZE + b'":1}',
}


class BoundedSliceTests(SynchronousTestCase):
    def test_no_token_read_at_once(self) -> None:
        """
        However a body is made (many small values, deep nesting, one long
        string with or without escapes, one long number, one run of
        blanks), it is read over many slices (no token in one go), and its
        value or refusal is C{load_json}'s.
        """
        for shape, raw in ADVERSARIAL.items():
            slices, value = slices_of(load_json_sliced(raw, unique=("model",)))
            expected = outcome(lambda r=raw: load_json(r, unique=("model",)))
            got = ("refused", value[1]) if isinstance(value, tuple) else ("value", value)
            self.assertEqual(got, expected, shape)
            self.assertGreaterEqual(slices, len(raw) // (2 * PIECE), shape)

    def test_pieces_keep_the_value(self) -> None:
        """
        A long string is read in pieces cut where no escape, UTF-8
        character or surrogate pair is split: its value is C{json.loads}'s
        wherever the cuts fall, and so are the refusals of a bad escape, a
        control character or a missing quote past the first piece.
        """
        units = ["\\n", '\\"', "\\\\", "\\u00e9", "\\ud83d\\ude00", "a", "\u00e9", "\U0001f600", "\\/"]
        for shift in range(12):
            text = "x" * shift + "".join(units[(i * 7 + shift) % len(units)] for i in range(PIECE // 3))
            raw = ('{"model":"m","prompt":"' + text + '"}').encode()
            self.assertEqual(run_sliced(load_json_sliced(raw)), json.loads(raw), shift)
            for bad in (raw[:-2], raw.replace(b"\\n", b"\\q", 3), raw[:-3] + b"\x01\"}"):
                self.assertEqual(
                    outcome(lambda r=bad: run_sliced(load_json_sliced(r))), ("refused", "invalid_json"), shift
                )

    def test_numbers_at_the_window(self) -> None:
        """
        A number whose fraction or exponent starts at the edge of the
        window read at once is still read whole (as C{json.loads} reads it).
        """
        for k in (PIECE - 9, PIECE - 8, PIECE - 2, PIECE - 1, PIECE, PIECE + 1):
            for template in (b"[0.%s]", b"[1.5e-%s]", b"[%s.5]", b"[-%s]", b"[%se5]"):
                raw = template.replace(b"%s", b"1" * (k - 2))
                self.assertEqual(
                    outcome(lambda r=raw: run_sliced(load_json_sliced(r))), outcome(lambda r=raw: load_json(r)), raw[:12]
                )

    def test_kept_sample(self) -> None:
        """
        With C{kept_items} and C{kept_chars} each kept top-level value is a
        sample: its first values and characters, in document order; a value
        after a large one has a budget of its own, and the rest of the body
        is still checked.
        """
        messages = [{"role": "system", "content": "s" * 10}] * 100
        raw = json.dumps({"messages": messages, "prompt": "p" * 100, "model": "m"}).encode()
        value = run_sliced(load_json_sliced(raw, keep=("model", "messages", "prompt"), kept_items=30, kept_chars=80))
        self.assertEqual(value["model"], "m")
        self.assertEqual(value["prompt"], "p" * 80)
        kept = value["messages"]
        self.assertLess(len(kept), 30)
        self.assertEqual(kept[0], {"role": "system", "content": "s" * 10})
        bad = raw.replace(b'"model"', b'"x":[NaN],"model"')
        with self.assertRaises(JSONInputError):
            run_sliced(load_json_sliced(bad, keep=("model",), kept_items=1, kept_chars=1))


class SlicedChoiceTests(SynchronousTestCase):
    def test_which_bodies_are_sliced(self) -> None:
        """
        A body up to 256 KiB is parsed at once when it has few commas (its
        cost is then in long strings); one with many small values, or any
        larger one, in slices.
        """
        self.assertFalse(sliced(b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'))
        self.assertTrue(sliced(b'{"model":"m","messages":[' + b"{}," * 5000 + b"{}]}"))
        self.assertFalse(sliced(b'{"model":"m","prompt":"' + b"a" * 200_000 + b'"}'))
        self.assertTrue(sliced(b'{"model":"m","prompt":[' + b"1," * 20_000 + b"1]}"))
        self.assertTrue(sliced(b'{"model":"m","prompt":"' + b"a" * 300_000 + b'"}'))


class SampleAffinityTests(SynchronousTestCase):
    def test_prefix_key_from_the_sample(self) -> None:
        """
        The gateway's sample of a large conversation (the kept top-level
        values, bounded by L{KEPT_ITEMS} and L{KEPT_CHARS}) gives the prefix
        policy the key the whole body gives: its head and its first
        assistant turn come first.
        """
        turns = [{"role": "system", "content": "be brief " * 50}, {"role": "user", "content": "q" * 300}]
        turns += [{"role": ("assistant", "user")[i % 2], "content": f"turn {i} " * 20} for i in range(5000)]
        for messages in (turns, turns[:2]):
            raw = json.dumps({"model": "m", "messages": messages, "user": ""}).encode()
            sample = run_sliced(load_json_sliced(raw, unique=("model",), keep=KEPT_KEYS, kept_items=KEPT_ITEMS,
                                                 kept_chars=KEPT_CHARS))
            self.assertLess(len(sample["messages"]), len(messages) + 1)
            self.assertEqual(affinity_key(sample, None, PolicyConfig()), affinity_key(json.loads(raw), None,
                                                                                       PolicyConfig()))

    def test_long_first_turn(self) -> None:
        """
        A first message longer than the sample's character budget leaves
        the later messages their keys: the sample still shows an assistant
        turn, as the whole body does.
        """
        messages = [{"role": "user", "content": "q" * (KEPT_CHARS + 10)}, {"role": "assistant", "content": "a"}]
        raw = json.dumps({"model": "m", "messages": messages}).encode()
        sample = run_sliced(load_json_sliced(raw, keep=KEPT_KEYS, kept_items=KEPT_ITEMS, kept_chars=KEPT_CHARS))
        self.assertEqual(sample["messages"][1], {"role": "assistant", "content": "a"})
        self.assertEqual(affinity_key(sample, None, PolicyConfig()), affinity_key(json.loads(raw), None,
                                                                                   PolicyConfig()))
