"""
What L{llmgw.gateway.wire}'s fast path needs to know of a Twisted TCP
transport beyond its public interface, in one place.

To send on a connection's socket itself rather than through C{write}, the
fast path must know that the transport holds no bytes of its own (they
would have to go first) and that it is not closing or aborting. Twisted
says neither publicly: it is in the attributes L{ATTRIBUTES} lists, which
this module alone reads. They were checked against the Twisted releases
L{TWISTED_RANGE} gives (setup.cfg bounds the install to the same range,
and tests/test_transportpeek.py pins each attribute's meaning).

L{raw_socket} is the gate: it returns the socket to send on only for a
TCP transport of a Twisted inside that range that has every attribute;
anything else (another Twisted, another transport, a missing attribute)
gets C{None}, and the caller uses the transport's C{write}, the public
path, which is slower but always right.
"""

from __future__ import annotations

import socket
from typing import Any, Final

from twisted.copyright import version as _twisted_version
from twisted.internet.tcp import Connection

#: The Twisted releases (year, month) these attributes were checked
#: against: from the first setup.cfg allows up to, not including, the
#: second. setup.cfg's bound on Twisted says the same.
TWISTED_RANGE: Final = ((24, 7), (27, 0))

#: Every attribute of Twisted's TCP transport (L{twisted.internet.tcp.Connection}
#: and its base, L{twisted.internet.abstract.FileDescriptor}) read here,
#: besides the public C{getHandle()}.
ATTRIBUTES: Final = (
    # Bytes written since the last send, not yet in dataBuffer.
    "_tempDataLen",
    # Bytes being sent, and how far into them the socket has taken.
    "dataBuffer",
    "offset",
    # loseConnection() was called, or the connection is (still) open.
    "disconnecting",
    "connected",
    # loseWriteConnection() was called, or has shut the sending side.
    "_writeDisconnecting",
    "_writeDisconnected",
    # abortConnection() was called.
    "_aborting",
    # The reactor the transport is on (whose turn the burst follows).
    "reactor",
)


def installed_twisted() -> tuple[int, int]:
    """
    The installed Twisted's release, C{(year, month)}.
    """
    year, month = _twisted_version.split(".")[:2]
    return int(year), int(month)


def twisted_in_range(release: tuple[int, int] | None = None) -> bool:
    """
    Whether the Twisted release C{(year, month)} (default: the one
    installed) lies in L{TWISTED_RANGE}.
    """
    if release is None:
        release = installed_twisted()
    low, high = TWISTED_RANGE
    return low <= release < high


def raw_socket(transport: Any, release: tuple[int, int] | None = None) -> socket.socket | None:
    """
    The socket to send C{transport}'s bytes on directly, or C{None} when
    only its C{write} may be used: it is not a plain TCP transport (TLS, a
    test's), the Twisted release C{release} (default: the one installed)
    is outside L{TWISTED_RANGE}, or the transport lacks one of
    L{ATTRIBUTES}. Once it returned a socket, L{queued} and L{busy} may be
    asked of the transport.
    """
    if not twisted_in_range(release) or not isinstance(transport, Connection):
        return None
    for name in ATTRIBUTES:
        if not hasattr(transport, name):
            return None
    handle = transport.getHandle()
    return handle if isinstance(handle, socket.socket) else None


def reactor_of(transport: Any) -> Any:
    """
    The reactor C{transport} runs on (one L{raw_socket} accepted).
    """
    return transport.reactor


def queued(t: Any) -> bool:
    """
    Whether the transport C{t} (one L{raw_socket} accepted) holds bytes
    of its own, not yet sent.
    """
    return bool(t._tempDataLen or t.offset != len(t.dataBuffer))


def busy(t: Any) -> bool:
    """
    Whether bytes for the transport C{t} (one L{raw_socket} accepted) must
    go through its own C{write}: it holds bytes of its own, or it is
    closing, closed or aborting.
    """
    return bool(
        t._tempDataLen
        or t.offset != len(t.dataBuffer)
        or t.disconnecting
        or not t.connected
        or t._writeDisconnecting
        or t._writeDisconnected
        or t._aborting
    )
