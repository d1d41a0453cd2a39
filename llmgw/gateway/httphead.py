"""
Reading an HTTP/1.1 request head: the request line and the header lines,
checked as strictly as the gateway's front needs (L{llmgw.gateway.front}).

L{parse_head} is pure: it takes the head's bytes (without the blank line
that ends it) and returns what the connection needs to frame the body and
build the request, or raises L{HeadRefused} with the answer to give.
"""

from __future__ import annotations

import re
from typing import Final, TypeAlias

#: The most a request line and its headers may take.
MAX_HEAD: Final = 64 * 1024
#: The most header lines a request may have.
MAX_HEADERS: Final = 100
#: tchar (RFC 9110 §5.6.2): what header names and methods are made of.
_TCHAR: Final = b"!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
#: The bytes a head may hold: visible ASCII, obs-text, space and HTAB in
#: values, and CRLF between lines; anything else is a control character.
_HEAD_BYTES: Final = bytes(range(0x20, 0x7F)) + bytes(range(0x80, 0x100)) + b"\t\r\n"
#: A head whose lines all end in CRLF, with no control byte (but HTAB),
#: whose request line is a token (the method), a target and a version
#: separated by single spaces (its three parts are the groups), and whose
#: header lines are a token, a colon and a value: what the per-line checks
#: of L{parse_head} would accept (possessive: nothing to backtrack into).
_WELL_FORMED: Final = re.compile(
    rb"([!#$%&'*+\-.^_`|~0-9A-Za-z]++) ([\x21-\x7e\x80-\xff]++) ([\x21-\x7e\x80-\xff]*+)"
    rb"(?:\r\n[!#$%&'*+\-.^_`|~0-9A-Za-z]++:[\t\x20-\x7e\x80-\xff]*+)*+"
)
#: In a well-formed head, each header's name and its value less the
#: blanks around it.
_FIELD: Final = re.compile(rb"\r\n([^:]++):[ \t]*+((?:[^\r]*[^\r \t])?)")
#: The header names L{parse_head} reads (all others are only passed on).
_SPECIAL: Final = frozenset(
    {b"host", b"content-length", b"transfer-encoding", b"authorization", b"connection", b"expect"}
)
_CRLF: Final = b"\r\n"
#: How much of a client's string a refusal quotes.
_QUOTE: Final = 80


def _quote(data: bytes) -> str:
    """
    A bounded, printable quotation of what a client sent.
    """
    if len(data) > _QUOTE:
        return f"{data[:_QUOTE]!r}... ({len(data)} bytes)"
    return repr(data)


class HeadRefused(Exception):
    """
    A head the front does not accept: answer C{status} with C{message}
    (OpenAI's error C{code}), then close.
    """

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(status, message, code)
        self.status = status
        self.message = message
        self.code = code


#: What L{parse_head} returns: method, URI, whether HTTP/1.0, the headers
#: (names in lower case, in arrival order), the Content-Length value as
#: sent (or None), whether the body is chunked, whether the connection may
#: be kept alive after the response, and whether the client expects a
#: 100 Continue.
Head: TypeAlias = tuple[bytes, bytes, bool, list[tuple[bytes, bytes]], bytes | None, bool, bool, bool]


def parse_head(head: bytes) -> Head:
    """
    Read a request head: lines ending in CRLF (a bare CR or LF refused),
    no control bytes, a request line of three parts, HTTP/1.1 or 1.0, at
    most L{MAX_HEADERS} header lines whose names are tokens, one
    C{Content-Length} value (repeats must agree) or chunked
    C{Transfer-Encoding} and not both, exactly one C{Host} in HTTP/1.1
    (at most one in 1.0), at most one C{Authorization}.

    A target in absolute form (C{http://host/path}, RFC 9112 §3.2.2; the
    scheme C{http} or C{https}, no user info) is returned as its path and
    query (origin form), and its authority replaces the C{Host} header
    (added in HTTP/1.0 when there was none), as an origin server must read
    it. Any other target that does not start with C{/} is refused.

    @raise HeadRefused: with the status (400, 431, 501, 505) and message
        to answer with.
    """
    fields: list[tuple[bytes, bytes]] | None = None
    well_formed = _WELL_FORMED.fullmatch(head)
    if well_formed is not None:
        # The common case: its lines checked, and its request line split, in
        # one C scan, its fields read in another (names still to lower,
        # values without their blanks).
        method, uri, version = well_formed.group(1, 2, 3)
        fields = _FIELD.findall(head, well_formed.end(3))
        lines: list[bytes] = []
        count = len(fields)
    else:
        lines = head.split(b"\r\n")
        count = len(lines) - 1
        if head.count(b"\n") != count or head.count(b"\r") != count:
            raise HeadRefused(400, "The request head has a bare CR or LF", "bad_request")
        if head.translate(None, _HEAD_BYTES):
            raise HeadRefused(400, "The request head has a control character", "bad_request")
        first = lines[0]
        parts = first.split(b" ")
        if (len(parts) != 3 or not parts[0] or parts[0].translate(None, _TCHAR) or not parts[1]
                or first.find(b"\t") >= 0):
            raise HeadRefused(400, f"Malformed request line {_quote(first)}", "bad_request")
        method, uri, version = parts
    if version == b"HTTP/1.1":
        http10 = False
    elif version == b"HTTP/1.0":
        http10 = True
    elif version.startswith(b"HTTP/"):
        raise HeadRefused(505, f"HTTP version {version[:20]!r} is not supported", "bad_request")
    else:
        raise HeadRefused(400, f"Malformed request line {_quote(head.partition(_CRLF)[0])}", "bad_request")
    if count > MAX_HEADERS:
        raise HeadRefused(431, f"The request has over {MAX_HEADERS} header lines", "too_many_headers")
    headers: list[tuple[bytes, bytes]]
    # The first malformed header line, refused after the lines before it.
    bad: bytes | None = None
    if fields is None:
        headers = []
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep or not name or name.translate(None, _TCHAR):
                bad = line
                break
            headers.append((name.lower(), value.strip(b" \t")))
    else:
        headers = [(name.lower(), value) for name, value in fields]
    length: bytes | None = None
    chunked = False
    connection: bytes | None = None
    expect = False
    hosts = 0
    authorizations = 0
    for name, value in headers:
        if name not in _SPECIAL:
            # Most headers: one set lookup, not six comparisons.
            continue
        if name == b"host":
            hosts += 1
        elif name == b"content-length":
            if not value.isdigit() or (length is not None and value != length):
                raise HeadRefused(400, f"Bad Content-Length {_quote(value)}", "bad_request")
            length = value
        elif name == b"transfer-encoding":
            if value.lower() != b"chunked" or chunked:
                raise HeadRefused(
                    501, f"Transfer-Encoding {_quote(value)} is not supported (only chunked)", "bad_request"
                )
            chunked = True
        elif name == b"authorization":
            authorizations += 1
        elif name == b"connection":
            connection = value.lower()
        else:
            expect = value.lower() == b"100-continue"
    if bad is not None:
        # Also an obs-fold line (it starts with a blank) and a blank
        # before the colon, which smuggling relies on.
        raise HeadRefused(400, f"Malformed header line {_quote(bad)}: the name must be a token", "bad_request")
    if chunked and length is not None:
        raise HeadRefused(400, "A request cannot have both Content-Length and Transfer-Encoding", "bad_request")
    if hosts > 1 or (hosts == 0 and not http10):
        raise HeadRefused(
            400,
            "An HTTP/1.1 request needs exactly one Host header" if hosts == 0
            else "A request cannot have more than one Host header",
            "bad_request",
        )
    if authorizations > 1:
        # Which one counts would differ between the gateway and whatever
        # reads the request after it.
        raise HeadRefused(400, "A request cannot have more than one Authorization header", "bad_request")
    if uri[:1] != b"/":
        uri, authority = _absolute_form(uri)
        headers = [(n, v) for n, v in headers if n != b"host"]
        headers.append((b"host", authority))
    keep_alive = not http10
    if connection is not None:
        if b"close" in connection:
            keep_alive = False
        elif http10 and b"keep-alive" in connection:
            keep_alive = True
    if chunked and http10:
        # RFC 9112 §6.1: an HTTP/1.0 message with Transfer-Encoding has
        # faulty framing; the connection closes after the response.
        keep_alive = False
    return method, uri, http10, headers, length, chunked, keep_alive, expect


def _absolute_form(uri: bytes) -> tuple[bytes, bytes]:
    """
    The path and query (origin form) and the authority of the absolute-form
    target C{uri}.

    @raise HeadRefused: 400, C{uri} is not an C{http} or C{https} URL with
        a host and no user info.
    """
    scheme, sep, rest = uri.partition(b"://")
    if not sep or scheme.lower() not in (b"http", b"https"):
        raise HeadRefused(
            400,
            f"Malformed request target {_quote(uri)}: it must be a path, or an http or https URL",
            "bad_request",
        )
    cut = len(rest)
    for mark in (b"/", b"?"):
        i = rest.find(mark)
        if 0 <= i < cut:
            cut = i
    authority = rest[:cut]
    path = rest[cut:]
    if not authority or authority.find(b"@") >= 0:
        raise HeadRefused(
            400, f"Malformed request target {_quote(uri)}: its URL needs a host and no user info", "bad_request"
        )
    if path[:1] != b"/":
        path = b"/" + path
    return path, authority


def head_so_far(buf: bytes | bytearray, pos: int, size: int, seen: int) -> tuple[int, str, str] | None:
    """
    The refusal (status, message, code) that the incomplete head in
    C{buf[pos:size]} earns now, C{None} when there is none yet: over
    L{MAX_HEAD} bytes, or a bare CR or LF, which cannot be part of a valid
    head, so that it is refused at once rather than at the head timeout.
    Only the bytes from C{seen} on are looked at (those before it were).
    """
    if size - pos > MAX_HEAD:
        return 431, f"The request head is over {MAX_HEAD} bytes", "head_too_large"
    i = buf.find(b"\n", seen)
    while i >= 0:
        if i == pos or buf[i - 1] != 13:
            return 400, "The request head has a bare LF (lines must end in CRLF)", "bad_request"
        i = buf.find(b"\n", i + 1)
    i = buf.find(b"\r", seen)
    while 0 <= i < size - 1:
        if buf[i + 1] != 10:
            return 400, "The request head has a bare CR (lines must end in CRLF)", "bad_request"
        i = buf.find(b"\r", i + 1)
    return None
