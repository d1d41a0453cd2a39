"""
The admin API on a member of an HA control plane that does not lead: what
it answers itself, what it answers from what the leader published in etcd,
and where it sends the client for the rest (L{to_leader}).

It reads the member through the control plane's C{ha} attribute (C{None}
without HA): C{status()}, C{serves_routes()} and C{followed_fleet()}; it
never imports the HA package, which sits above this one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from urllib.parse import quote, urlsplit

from twisted.logger import Logger

from llmgw.control.admin.auth import known_admin
from llmgw.control.admin.base import JSON_TYPE, Refused, since_seconds
from llmgw.routing import RoutesDataError
from llmgw.untrusted import clip

#: What every member of an HA control plane answers itself, leading or
#: not: its own status, who it takes the client for, its metrics, its
#: embedded gateway's usage and playground, its own TLS reload, and the fleet page's files
#: (whose API calls are sent on like any other).
LOCAL_PATHS = frozenset({
    (), ("metrics",), ("api", "v1", "status"), ("api", "v1", "whoami"), ("api", "v1", "usage"),
    ("api", "v1", "tls", "reload"), ("api", "v1", "playground"), ("api", "v1", "playground", "chat"),
})
#: What a member that does not lead answers from the routing table the
#: leader published, once it holds one; the watch stream too, when it
#: follows the routes alone (C{?only=routes} or the C{gateway} role).
FOLLOWED_PATHS = frozenset({("api", "v1", "routes")})
#: What such a member answers from the fleet views the leader published,
#: once it holds them.
FLEET_FOLLOWED_PATHS = frozenset({("api", "v1", "nodes"), ("api", "v1", "replicas"), ("api", "v1", "events")})
#: The header with which such a member names the leader's admin URL.
LEADER_HEADER = b"x-llmgw-leader"

def local_path(path: list[str]) -> bool:
    """
    Whether a member answers C{path} itself rather than sending the client
    to the leader (L{LOCAL_PATHS}, C{/page/...}, and the certificate
    requests, which wait in the memory of the member a node asked).
    """
    return tuple(path) in LOCAL_PATHS or path[:1] == ["page"] or path[:3] == ["api", "v1", "csr"]


def leader_location(status: dict[str, Any], uri: bytes) -> tuple[str | None, dict[str, Any]] | None:
    """
    Where a request for C{uri} (the request target, whose path and query
    are kept) goes, given an HA member's C{status} (C{HAMember.status}):
    C{None} when this member leads (it answers itself); else the leader's
    admin URL with that path and query, or C{None} in its place when no
    other member is known to lead with an admin URL; and the status.
    """
    if status.get("role") == "leader":
        return None
    base = status.get("leader_admin_url") or ""
    leader = status.get("leader_id")
    if not leader or leader == status.get("member_id") or not isinstance(base, str) or not base:
        return None, status
    parts = urlsplit(uri.decode("latin-1"))
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    # Bytes past ASCII, as the client sent them, percent-encoded.
    target = quote(target.encode("latin-1"), safe="/?&=%:@!$'()*+,;~-._")
    return base.rstrip("/") + target, status


def routes_only(request: Any) -> bool:
    """
    Whether a watch request follows the routes alone: C{?only=routes}, or
    an admin of the C{gateway} role (who gets nothing else).
    """
    admin = known_admin(request)
    if admin is not None and admin.role == "gateway":
        return True
    return bool(request.args.get(b"only") == [b"routes"])


def to_leader(request: Any, path: list[str], ha: Any, who: str, log: Logger) -> Callable[[], Any] | None:
    """
    On a member of an HA control plane (C{ha}) that does not lead: refuse
    with a C{307} whose C{Location} is the same request on the leader's
    admin URL (as the leader published it in etcd), or with a C{503} naming
    the leader when its URL is unknown (no leader, an election under way,
    or a leader whose admin API listens on every address and that has no
    C{--advertise-admin}: the leader's own reason is given). What is this member's own
    (L{local_path}) is answered here, and so are the routes once it follows
    the published table. A read of nodes, replicas or events, once this
    member holds the fleet views the leader published, is answered from
    them: the handler to call is returned (C{None}: answer as usual). The
    root calls it after the certificate and role checks: a request this
    member refuses is not redirected. C{who} names the requester in what
    it logs to C{log}.

    @raise Refused: 307 or 503, as above; 400, a malformed C{?since=}.
    """
    if ha is None or local_path(path):
        return None
    if tuple(path) == ("api", "v1", "watch") and routes_only(request) and ha.serves_routes():
        # A watch of the routes alone follows the published table here.
        return None
    if tuple(path) in FOLLOWED_PATHS and ha.serves_routes():
        # Answered here; the header tells a gateway where the leader is
        # (its watch stream and demand go there).
        leader_url = ha.status().get("leader_admin_url")
        if isinstance(leader_url, str) and leader_url:
            request.setHeader(LEADER_HEADER, leader_url.encode("utf-8", "replace"))
        return None
    if tuple(path) in FLEET_FOLLOWED_PATHS and request.method in (b"GET", b"HEAD"):
        followed = ha.followed_fleet()
        view = followed_view(request, path[-1], followed, who, log) if followed is not None else None
        if view is not None:
            return view
    where = leader_location(ha.status(), request.uri)
    if where is None:
        return None
    location, st = where
    leader = st.get("leader_id")
    if location is None:
        raise Refused(
            503,
            f"this control-plane member ({st.get('member_id')}) does not lead, and "
            + (f"the leader {leader} published no admin URL "
               f"({st.get('leader_admin_problem') or 'set --advertise-admin on each member'})" if leader
               else "no leader is known (an election is under way, or etcd is unreachable)")
            + "; try another member",
            headers={b"retry-after": b"1"},
            extra={"leader_id": leader, "leader_admin_url": None},
        )
    raise Refused(
        307,
        f"this control-plane member ({st.get('member_id')}) does not lead: {leader} does, "
        f"at {clip(location)}",
        headers={b"location": location.encode("utf-8", "replace")},
        extra={"leader_id": leader, "leader_admin_url": st.get("leader_admin_url"), "location": location},
    )


def followed_view(request: Any, kind: str, followed: Any, who: str, log: Logger) -> Callable[[], Any] | None:
    """
    C{GET /api/v1/nodes}, C{/replicas} or C{/events} on a member that does
    not lead, from the fleet views the leader published (C{followed}, a
    C{FleetDocument}): the leader's answer, with C{published_at} (the
    leader's clock when it wrote them) and C{published_by} (the leader), and
    the leader's admin URL in the L{LEADER_HEADER} header. Nodes and
    replicas are the bytes the leader packed, answered as they are (not
    parsed here). C{None}: the part is unreadable (logged; the client is
    sent to the leader).

    @raise Refused: 400, a malformed C{?since=} (events).
    """
    since = since_seconds(request) if kind == "events" else 0.0
    try:
        if kind == "events":
            events = [e for e in followed.events()
                      if isinstance(e, dict) and isinstance(e.get("time"), (int, float)) and e["time"] > since]
            answer: Any = {"published_at": followed.published_at, "published_by": followed.leader,
                           "events": events}
        else:
            answer = followed.part(kind) + b"\n"
    except RoutesDataError as e:
        log.error("admin API: the {kind} the leader published are unreadable ({error}); {client} "
                  "is sent to the leader", kind=kind, error=str(e), client=who)
        return None
    leader_url = followed.leader_admin_url
    if leader_url:
        request.setHeader(LEADER_HEADER, leader_url.encode("utf-8", "replace"))
    if isinstance(answer, bytes):
        request.setResponseCode(200)
        request.setHeader(b"content-type", JSON_TYPE)
    return lambda: answer
