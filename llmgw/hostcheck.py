"""
Which C{Host} names an HTTP surface (the admin API, the gateway) answers to.

A page in an operator's browser whose name rebinds to 127.0.0.1 reaches a
loopback listener with its own name in C{Host}; refusing every name the
server does not serve (421 Misdirected Request) closes that hole. Served
names are the loopback names (C{localhost}, C{127.0.0.1}, C{[::1]}), the
address the listener is bound to unless it is a wildcard (C{0.0.0.0} or
C{::} serve every address, so they name none), and the names an operator
lists. A listed entry is C{NAME} (any port), C{NAME:PORT} (that port only),
C{.example.com} (that name and every name under it) or C{*} (any name: the
check is off).

This module sits below C{llmgw.control} and C{llmgw.gateway} and imports
neither.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from typing import Final

LOOPBACK_NAMES: Final = ("localhost", "127.0.0.1", "[::1]")
_WILDCARDS: Final = frozenset({"", "0.0.0.0", "::", "[::]", "*"})
_SEEN_MAX: Final = 256
_NAME: Final = re.compile(r"[a-z0-9_](?:[a-z0-9_.-]*[a-z0-9_])?")


class HostListError(ValueError):
    """
    A listed host name is malformed; the message names it.
    """


def _split(text: str) -> tuple[str, str | None] | None:
    """
    C{text} (lower case) as (host, port or C{None}); C{None} when it is not
    C{host[:port]}. A host keeps its IPv6 brackets and loses one trailing dot.
    """
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            return None
        host, rest = text[: end + 1], text[end + 1 :]
        if rest and not rest.startswith(":"):
            return None
    else:
        i = text.rfind(":")
        host, rest = (text, "") if i < 0 else (text[:i], text[i:])
        if ":" in host:
            return None
    port = rest[1:] if rest else None
    if port == "":
        port = None
    if port is not None and not (port.isascii() and port.isdigit() and len(port) <= 5):
        return None
    if host.endswith("."):
        host = host[:-1]
    if not host:
        return None
    return host, port


def _bracketed(host: str) -> str:
    """
    C{host} as it appears in a C{Host} header: an IPv6 address in brackets.
    """
    host = host.strip().lower()
    if host.startswith("["):
        return host
    try:
        if ipaddress.ip_address(host).version == 6:
            return f"[{host}]"
    except ValueError:
        pass
    return host


def parse_hosts(spec: str) -> list[str]:
    """
    A comma-separated list of host entries, checked.

    @raise HostListError: an entry is not C{*}, C{NAME}, C{NAME:PORT},
        C{.SUFFIX}, an IP address or C{[IPV6]}, optionally with a port.
    """
    out = []
    for raw in spec.split(","):
        entry = raw.strip().lower()
        if not entry:
            continue
        if entry == "*":
            out.append(entry)
            continue
        body = entry[1:] if entry.startswith(".") else entry
        parts = _split(_bracketed(body) if body.count(":") > 1 else body)
        ok = parts is not None
        if parts is not None:
            host = parts[0]
            if host.startswith("["):
                try:
                    ok = ipaddress.ip_address(host[1:-1]).version == 6 and not entry.startswith(".")
                except ValueError:
                    ok = False
            else:
                ok = bool(_NAME.fullmatch(host))
        if not ok:
            raise HostListError(
                f"{raw.strip()!r} is not a host name: write NAME, NAME:PORT, .DOMAIN, an IP "
                "address ([ADDRESS] for IPv6) or *, comma-separated"
            )
        out.append(_bracketed(body) if not entry.startswith(".") else entry)
    return out


def _is_loopback(host: str) -> bool:
    host = host.strip().lower().strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def unlisted_names_warning(what: str, bound: str, names: Iterable[str], option: str) -> str | None:
    """
    The start-up warning for C{what} (a listener bound to C{bound}) that
    other machines can reach but whose C{option} lists no names
    (C{names} empty): their requests name it by an address or a name it
    does not serve, and are answered 421. C{None} on loopback, or when
    names are listed.
    """
    if _is_loopback(bound) or any(n.strip() for n in names):
        return None
    if bound.strip().lower() in _WILDCARDS:
        where = (f"listens on every address ({bound or '*'}) but answers only to the loopback "
                 f"names: every request from another machine")
    else:
        where = (f"listens on {bound} but answers only to that address and the loopback names: "
                 f"a request from another machine that names it otherwise")
    return (
        f"{what} {where} is answered 421 Misdirected Request. Add {option} NAME,... with the "
        f"names and addresses clients use (or {option} '*' for any name)"
    )


class HostCheck:
    """
    The C{Host} values a server answers to (see the module's docstring).

    @param names: entries as L{parse_hosts} returns them, added to the
        loopback names.
    @param bound: the host the listener is bound to; served unless it is a
        wildcard.
    @param option: the option that lists names, for refusal messages.
    """

    def __init__(self, names: Iterable[str] = (), bound: str | None = None, option: str = "--hosts"):
        self.option = option
        self.any_name = False
        self._names: set[str] = set(LOOPBACK_NAMES)
        self._with_port: set[tuple[str, str]] = set()
        self._suffixes: list[str] = []
        # Values already allowed, as sent: clients use a handful, so most
        # requests cost one set lookup. Refused values are never kept.
        self._seen: set[bytes | str] = set()
        if bound is not None and bound.strip().lower() not in _WILDCARDS:
            self._names.add(_bracketed(bound))
        for entry in names:
            entry = entry.strip().lower()
            if entry == "*":
                self.any_name = True
            elif entry.startswith("."):
                self._suffixes.append(entry)
            else:
                parts = _split(entry)
                if parts is None:
                    raise HostListError(f"{entry!r} is not a host name")
                host, port = parts
                if port is None:
                    self._names.add(host)
                else:
                    self._with_port.add((host, port))

    def served(self) -> list[str]:
        """
        The entries served, for documentation and logs.
        """
        if self.any_name:
            return ["*"]
        out = sorted(self._names) + sorted(f"{h}:{p}" for h, p in self._with_port)
        return out + sorted(self._suffixes)

    def allows(self, value: bytes | str | None) -> bool:
        """
        Whether a request with this C{Host} value may be answered. A request
        with no C{Host} names no other server (browsers always send one), so
        it is allowed here; HTTP/1.1 requires the header, and the HTTP layer
        refuses a request without it.
        """
        if value is None or self.any_name or value in self._seen:
            return True
        if self._allows(value):
            if len(self._seen) < _SEEN_MAX:
                self._seen.add(value)
            return True
        return False

    def _allows(self, value: bytes | str) -> bool:
        if isinstance(value, bytes):
            try:
                text = value.decode("ascii")
            except UnicodeDecodeError:
                return False
        else:
            text = value
        text = text.strip(" \t").lower()
        if text in self._names:
            return True
        parts = _split(text)
        if parts is None:
            return False
        host, port = parts
        if host in self._names:
            return True
        if port is not None and (host, port) in self._with_port:
            return True
        for suffix in self._suffixes:
            if host.endswith(suffix) or host == suffix[1:]:
                return True
        return False
