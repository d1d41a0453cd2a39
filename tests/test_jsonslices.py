"""
Tests for L{llmgw.jsonslices} and the gateway's sliced parse of large
bodies (L{llmgw.gateway.bigbody}).
"""

from __future__ import annotations

import json
from typing import Any

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from llmgw.gateway.bigbody import SlicedParses
from llmgw.jsonslices import SLICE_TOKENS, load_json_sliced, run_sliced
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
