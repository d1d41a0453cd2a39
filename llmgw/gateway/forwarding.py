"""
The head of the request a replica is sent: the client's request line and
headers less those that are the gateway's business (hop-by-hop ones, those
the client's C{Connection} names, and any forwarding headers the client
sent, which anyone can forge), with the gateway's own forwarding headers
(L{FORWARDED_HEADERS}) in their place.

On every proxied request's path, and compiled with the rest of it
(setup.py's C{COMPILED}).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Final

from llmgw.gateway.front import FrontRequest

#: Request headers that are the gateway's business, not the replica's.
_DROP_REQUEST: Final = frozenset(
    {
        b"connection", b"keep-alive", b"proxy-authorization", b"proxy-connection", b"te",
        b"trailer", b"transfer-encoding", b"upgrade", b"host", b"content-length",
        b"authorization", b"expect",
    }
)
#: Request headers that say who the client is and how it came: the gateway
#: writes its own, never passes on the client's (which anyone can forge).
_FORWARDING: Final = frozenset(
    {b"forwarded", b"x-forwarded-for", b"x-forwarded-proto", b"x-forwarded-host", b"x-real-ip"}
)
_DROP_FORWARDED: Final = _DROP_REQUEST | _FORWARDING
#: The scheme clients reach the gateway by (its front serves plain HTTP).
_SCHEME: Final = b"http"
#: A C{Host} value safe to copy into X-Forwarded-Host and Forwarded.
_HOST_VALUE: Final = re.compile(rb"[A-Za-z0-9._\-]{1,253}(?::[0-9]{1,5})?|\[[0-9A-Fa-f:.]{2,45}\](?::[0-9]{1,5})?")

#: What the gateway tells a replica of the client, by the name of the
#: setting: C{x-forwarded}, the pair most servers read (C{X-Forwarded-For},
#: C{X-Forwarded-Proto}, as Envoy sends); C{full}, those with
#: C{X-Forwarded-Host}, C{X-Real-IP} and RFC 7239's C{Forwarded}; C{none}.
FORWARDED_HEADERS: Final = ("x-forwarded", "full", "none")


def connection_options(headers: Iterable[tuple[bytes, bytes]]) -> frozenset[bytes]:
    """
    The header names (lower case) that the C{Connection} headers among
    C{headers} list: they are for this hop only.
    """
    named: set[bytes] = set()
    for name, value in headers:
        if name == b"connection":
            for token in value.split(b","):
                token = token.strip(b" \t").lower()
                if token:
                    named.add(token)
    return frozenset(named)


def forwarded_head(request: FrontRequest, body_length: int, forwarded: str = "x-forwarded") -> bytes:
    """
    The request line and the headers to forward, up to (not including) the
    C{Host} header, which depends on the replica.

    Hop-by-hop headers (and those the client's C{Connection} names) are
    dropped; C{Forwarded}, C{X-Forwarded-For}, C{-Proto}, C{-Host} and
    C{X-Real-IP} are the gateway's own, replacing any the client sent.
    """
    headers = request.headers
    parts = [request.method, b" ", request.uri, b" HTTP/1.1\r\n"]
    host = None
    named = False
    for name, value in headers:
        if name not in _DROP_FORWARDED:
            parts += (name, b": ", value, b"\r\n")
        elif name == b"connection":
            named = True
        elif name == b"host" and host is None:
            host = value
    if named:
        # Rare enough to pay a second pass: a Connection header naming
        # more than the hop-by-hop headers already dropped.
        options = connection_options(headers) - _DROP_FORWARDED
        if options:
            parts = parts[:4]
            for name, value in headers:
                if name not in _DROP_FORWARDED and name not in options:
                    parts += (name, b": ", value, b"\r\n")
    key = (request.channel.peer_host, host, forwarded)  # request.client_host, without the property's call
    block = _FORWARDING_BLOCKS.get(key)
    if block is None:
        block = _forwarding_block(*key)
        if len(_FORWARDING_BLOCKS) < 1024:
            _FORWARDING_BLOCKS[key] = block
    parts += (block, b"content-length: %d\r\n" % body_length)
    return b"".join(parts)


#: The forwarding headers per (client address, Host): few clients send
#: most requests, so most requests find theirs here.
_FORWARDING_BLOCKS: Final[dict[tuple[str | None, bytes | None, str], bytes]] = {}


def _forwarding_block(client: str | None, host: bytes | None, which: str) -> bytes:
    """
    The gateway's own forwarding headers (the set L{FORWARDED_HEADERS}
    names C{which}) for a request from C{client} that asked for C{host}.
    """
    if which == "none":
        return b""
    if which == "x-forwarded":
        if client:
            return b"x-forwarded-for: %s\r\nx-forwarded-proto: %s\r\n" % (client.encode(), _SCHEME)
        return b"x-forwarded-proto: %s\r\n" % _SCHEME
    parts: list[bytes] = []
    forwarded: list[bytes] = []
    if client:
        ip = client.encode()
        parts += (b"x-forwarded-for: ", ip, b"\r\nx-real-ip: ", ip, b"\r\n")
        forwarded.append(b'for="[%s]"' % ip if b":" in ip else b"for=" + ip)
    if host is not None and _HOST_VALUE.fullmatch(host) is not None:
        parts += (b"x-forwarded-host: ", host, b"\r\n")
        forwarded.append(b'host="%s"' % host)
    forwarded.append(b"proto=" + _SCHEME)
    parts += (b"x-forwarded-proto: ", _SCHEME, b"\r\nforwarded: ", b";".join(forwarded), b"\r\n")
    return b"".join(parts)


#: Names the replica that answered, in every proxied answer's head.
REPLICA_HEADER: Final = b"x-llmgw-replica"
_REPLICA_LINES: Final[dict[str, bytes]] = {}


def replica_line(replica_id: str) -> bytes:
    """
    C{replica_id}'s L{REPLICA_HEADER} line, after a CRLF as the lines of a
    relayed head's block are (the C{block} of
    L{llmgw.gateway.frontrequest.FrontRequest.start_response}); made once
    per replica.
    """
    line = _REPLICA_LINES.get(replica_id)
    if line is None:
        line = b"\r\n%s: %s" % (REPLICA_HEADER, replica_id.encode())
        if len(_REPLICA_LINES) < 4096:
            _REPLICA_LINES[replica_id] = line
    return line
