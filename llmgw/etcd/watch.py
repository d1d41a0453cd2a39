"""
A watch's streamed answer: L{WatchStream} splits it into JSON messages,
L{Watch} is what L{llmgw.etcd.client.EtcdClient.watch} hands its caller.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from twisted.internet import defer
from twisted.internet.protocol import Protocol
from twisted.python.failure import Failure
from twisted.web.client import ResponseDone

from llmgw.etcd.errors import EtcdUnavailable

#: The largest message a watch stream may send before it is closed; a
#: catalog is far smaller.
MAX_WATCH_MESSAGE = 4 * 1024 * 1024


class WatchStream(Protocol):
    """
    Splits a watch's streamed response into its JSON messages (one a
    line) and hands each to C{on_message}; a line over
    L{MAX_WATCH_MESSAGE} closes the stream.
    """

    def __init__(self, on_message: Callable[[dict[str, Any]], None], done: defer.Deferred[None]):
        self.on_message = on_message
        self.done = done
        self.buf = b""
        self.too_long = False

    def dataReceived(self, data: bytes) -> None:  # noqa: N802
        self.buf += data
        while True:
            nl = self.buf.find(b"\n")
            if nl < 0:
                break
            line, self.buf = self.buf[:nl], self.buf[nl + 1 :]
            if line.strip():
                self.on_message(json.loads(line))
        if len(self.buf) > MAX_WATCH_MESSAGE:
            self.too_long = True
            self.buf = b""
            self.transport.stopProducing()  # type: ignore[union-attr]

    def connectionLost(self, reason: Failure = Failure(ResponseDone())) -> None:  # noqa: B008,N802
        if self.done.called:
            return
        if self.too_long:
            self.done.errback(EtcdUnavailable(f"a watch message exceeded {MAX_WATCH_MESSAGE} bytes"))
        elif reason.check(ResponseDone):
            self.done.callback(None)
        else:
            self.done.errback(reason)


class Watch:
    """
    A running watch. C{done} fires (with C{None}) when the stream ends, or
    fails with why; C{cancel()} ends it. C{revision} is the newest revision
    the stream has reported, so a caller that restarts it can resume from
    C{revision + 1}.
    """

    def __init__(self) -> None:
        self.done: defer.Deferred[None] = defer.Deferred()
        self.revision = 0
        self._request: defer.Deferred[Any] | None = None
        self._stream: WatchStream | None = None

    def cancel(self) -> None:
        if not self.done.called:
            self.done.callback(None)
        if self._request is not None and not self._request.called:
            self._request.cancel()
        if self._stream is not None and self._stream.transport is not None:
            self._stream.transport.stopProducing()  # type: ignore[attr-defined]
