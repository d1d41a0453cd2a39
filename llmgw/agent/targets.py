"""
The control-plane members an agent knows (C{--control}, repeatable) and
the one it dials next (DESIGN §17).

L{ControlTargets} is the agent's client endpoint. It dials the current
member; a member that does not lead names the leader in its refusal
(L{redirect}), and the next attempt goes there, at once. Redirects are
bounded: more than C{max_redirects} in a row without a registration (two
members naming each other, say) are not followed, and the agent falls
back to trying each configured member in turn with its usual backoff. A
failed attempt, or a stream lost, moves to the next configured member.

A member left because it fell silent (frozen: its connection open, nothing
answered) is avoided until the agent registers somewhere: the rotation
passes it by and a redirect to it is not followed, since the other members
name it as leader until its lease in etcd runs out, and a dial to it would
wait out the Register timeout. The avoidance is bounded (it may lead again
after all: woken before its lease ran out); the member it lapses for is
then on probation (L{ControlTargets.probing}) until a registration, and a
dial to it waits for the Register's acknowledgement only as long as its
silence was allowed, so a member still frozen costs seconds, not the
Register timeout.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from twisted.internet import defer
from twisted.internet.interfaces import IStreamClientEndpoint
from twisted.logger import Logger
from zope.interface import implementer

from llmgw.addresses import AddressError, format_address, parse_address


def split_address(address: str) -> tuple[str, int]:
    """
    C{HOST:PORT} (IPv6 as C{[addr]:port}) as a pair.

    @raise ValueError: not a HOST:PORT.
    """
    try:
        host, port = parse_address(address, "")
    except AddressError as e:
        raise ValueError(str(e)) from e
    if not host or not port:
        raise ValueError(f"{address!r} is not HOST:PORT")
    return host, port


@implementer(IStreamClientEndpoint)
class ControlTargets:
    """
    @param addresses: the configured members, C{(host, port)}; at least one.
    @param make_endpoint: builds the endpoint that dials one member.
    @param on_target: told the C{HOST:PORT} of each member dialled.
    """

    log = Logger()

    def __init__(
        self,
        addresses: Sequence[tuple[str, int]],
        make_endpoint: Callable[[str, int], Any],
        on_target: Callable[[str], None] = lambda address: None,
        max_redirects: int | None = None,
    ):
        if not addresses:
            raise ValueError("an agent needs at least one control-plane address")
        self.addresses = [format_address(h, p) for h, p in addresses]
        self.make_endpoint = make_endpoint
        self.on_target = on_target
        self.index = 0
        #: The leader a member named, dialled next instead of the list.
        self.leader: str | None = None
        #: Redirects followed since the last registration.
        self.redirects = 0
        #: The member left for its silence, avoided until a registration.
        self.silent: str | None = None
        #: Redirects to it refused; past C{max_redirects} it is tried again.
        self.silent_refusals = 0
        #: The member whose avoidance lapsed, until a registration or until
        #: it is left for its silence again.
        self.probing: str | None = None
        self.max_redirects = max_redirects if max_redirects is not None else 2 * len(self.addresses) + 1

    @property
    def current(self) -> str:
        return self.leader or self.addresses[self.index]

    def connect(self, factory: Any) -> defer.Deferred[Any]:
        address = self.current
        try:
            host, port = split_address(address)
        except ValueError as e:
            self.log.warn("cannot dial {address} named as the leader: {error}", address=address, error=str(e))
            self.leader = None
            address = self.current
            host, port = split_address(address)
        self.on_target(address)
        return self.make_endpoint(host, port).connect(factory)  # type: ignore[no-any-return]

    def redirect(self, address: str) -> bool:
        """
        A member named C{address} as the leader: dial it next, unless that
        would be one redirect too many. Returns whether it is followed.
        """
        if self.redirects >= self.max_redirects:
            self.log.warn(
                "not following the redirect to {address}: {count} redirects in a row without "
                "registering; trying the configured members in turn",
                address=address, count=self.redirects,
            )
            self.leader = None
            self.redirects = 0
            self.failed()
            return False
        self.redirects += 1
        self.leader = address
        return True

    def failed(self) -> None:
        """The current member did not take us: try the next configured one."""
        if self.leader is not None:
            self.leader = None
        else:
            self.index = (self.index + 1) % len(self.addresses)
        if self.leader is None and self.addresses[self.index] == self.silent and len(self.addresses) > 1:
            self.index = (self.index + 1) % len(self.addresses)

    def left_silent(self, address: str) -> None:
        """
        The stream to C{address} was left for its silence: avoid it (see
        the module docstring) until a registration.
        """
        self.silent = address
        self.silent_refusals = 0
        self.probing = None

    def is_silent(self, address: str) -> bool:
        """
        Whether a redirect to C{address} is refused because it is the
        member left for its silence; after C{max_redirects} such refusals
        it is no longer avoided (it may lead again after all).
        """
        if address != self.silent:
            return False
        self.silent_refusals += 1
        if self.silent_refusals > self.max_redirects:
            self.probing = self.silent
            self.silent = None
            return False
        return True

    def registered(self) -> None:
        self.redirects = 0
        self.silent = None
        self.probing = None

    def __repr__(self) -> str:
        return f"<control plane {self.current} of {','.join(self.addresses)}>"
