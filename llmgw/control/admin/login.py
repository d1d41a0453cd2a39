"""
Login for people on an admin API served over TLS: a browser without an
admin certificate logs in with a user's name and password
(L{llmgw.control.core.users}) and gets a session cookie.

L{Logins} decides who a request is when its connection brought no client
certificate: the session its cookie names, whose user's role goes through
the same L{llmgw.control.admin.auth.role_allows} as a certificate's, and
whose writes must repeat the session's CSRF token in C{X-CSRF-Token}.
Without a certificate or a session only the page's own files, C{GET /},
C{GET /api/v1/whoami} (which then says no one) and C{POST /api/v1/login}
are served; anything else is a 401.

C{POST /api/v1/login {"user": NAME, "password": PASSWORD}} checks the
password in a thread (scrypt is slow on purpose; the reactor never
computes a hash) and answers C{{"user", "role", "csrf"}} with a cookie that
is C{HttpOnly}, C{Secure} and C{SameSite=Strict}. Failed logins are counted
per address and per user name; past L{MAX_FAILURES} in a minute either is
answered 429 with C{Retry-After}, and each failure is logged with the
address and the name, never the password. C{POST /api/v1/logout} ends the
session.
"""

from __future__ import annotations

import hmac
import math
from collections.abc import Callable
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from llmgw.control.admin import auth
from llmgw.control.admin.base import AdminNode, Refused, client_address, json_body
from llmgw.control.admin.sessions import MAX_FAILURES, FailureLimit, Session, SessionBook, stamp_of
from llmgw.control.core.users import MAX_PASSWORD, User, UserFile, verify_password

#: The session cookie's name.
COOKIE = b"llmgw_session"
#: The header every write with a session repeats the session's token in.
CSRF_HEADER = b"x-csrf-token"
#: Password checks running at once at most; past them a login is a 503
#: (each costs tens of MiB and a core for a tenth of a second).
MAX_VERIFYING = 4
#: What a request without a certificate or session may ask.
# C{whoami} is open so that a page not logged in learns it from a 200
# ({"role": null, "login": true}), not from an error in the browser's console.
_OPEN = {("GET", ()), ("POST", ("api", "v1", "login")), ("GET", ("api", "v1", "whoami"))}
_LOGOUT = ("POST", ("api", "v1", "logout"))


def cookie_value(request: Any, name: bytes) -> bytes | None:
    """
    The value of the cookie C{name} in C{request}'s C{Cookie} headers.
    """
    for header in request.requestHeaders.getRawHeaders(b"cookie") or []:
        for part in header.split(b";"):
            key, sep, value = part.strip().partition(b"=")
            if sep and key == name:
                return value
    return None


def session_of(request: Any) -> Session | None:
    """
    The session a request was let in with (by L{Logins.authorize}).
    """
    session = getattr(request, "llmgw_session", None)
    return session if isinstance(session, Session) else None


def role_of_user(role: str) -> str:
    """
    The admin role whose rules a user's role follows: an C{admin} user may
    do what an operator may.
    """
    return "operator" if role == "admin" else role


class Logins:
    """
    The users who may log in, their sessions and their failed logins.

    @param run_in_thread: C{f(callable, *args)} → a C{Deferred} of its
        result, computed off the reactor (by default the reactor's thread
        pool).
    """

    log = Logger()

    def __init__(self, users: UserFile, clock: IReactorTime,
                 run_in_thread: Callable[..., Deferred[Any]] | None = None,
                 sessions: SessionBook | None = None):
        self.users = users
        self.clock = clock
        self.sessions = sessions if sessions is not None else SessionBook(clock)
        self.by_address = FailureLimit(clock)
        self.by_user = FailureLimit(clock)
        self.verifying = 0
        if run_in_thread is None:
            from twisted.internet.threads import deferToThreadPool

            pool: Any = clock  # the reactor, which has the thread pool

            def run_in_thread(f: Callable[..., Any], *args: Any) -> Deferred[Any]:
                return deferToThreadPool(pool, pool.getThreadPool(), f, *args)
        self.run_in_thread = run_in_thread

    # -- who a request is ----------------------------------------------------------------

    def session(self, request: Any) -> Session | None:
        """
        The live session C{request}'s cookie names whose user still exists
        with the role and password it had; C{None} otherwise.
        """
        raw = cookie_value(request, COOKIE)
        if raw is None:
            return None
        session = self.sessions.find(raw.decode("latin-1"))
        if session is None:
            return None
        self.users.refresh()
        user = self.users.book.get(session.user)
        if (user is None or user.role != session.role
                or not hmac.compare_digest(stamp_of(user.role, user.hash), session.stamp)):
            self.sessions.close(session.id)
            return None
        return session

    def authorize(self, request: Any, method: str, path: list[str],
                  revoked: Callable[[], frozenset[int]] | None) -> None:
        """
        A request with a client certificate is judged by it, exactly as
        without logins (L{auth.authorize}). Without one: the page and the
        login are open; anything else needs a session whose role allows it,
        and a write the session's CSRF token.

        @raise Refused: 401, no session; 403, the role or the CSRF token.
        """
        if auth.has_certificate(request):
            auth.authorize(request, method, path, revoked)
            return
        session = self.session(request)
        if session is None:
            if (method, tuple(path)) in _OPEN or (method == "GET" and path[:1] == ["page"]):
                return
            raise Refused(401, "log in (POST /api/v1/login) or present an admin certificate",
                          headers={b"cache-control": b"no-store"})
        request.llmgw_session = session
        # Ending one's own session is no write to the fleet: every role may.
        if (method, tuple(path)) != _LOGOUT and not auth.role_allows(role_of_user(session.role), method, path):
            raise Refused(
                403,
                f"user {session.user!r} has role {session.role}, which may not {method} "
                f"{'/' + '/'.join(path)}",
            )
        if method != "GET" and not session.csrf_matches(request.getHeader(CSRF_HEADER)):
            raise Refused(403, "a write with a session must carry its CSRF token in X-CSRF-Token "
                               "(given at login and by GET /api/v1/whoami)")

    # -- logging in and out --------------------------------------------------------------

    def _limited(self, address: str, user: str) -> float | None:
        waits = [w for w in (self.by_address.retry_after(address), self.by_user.retry_after(user))
                 if w is not None]
        return max(waits) if waits else None

    def login(self, request: Any, body: dict[str, Any], log: Logger) -> Deferred[Any] | dict[str, Any]:
        """
        Check C{body}'s user and password and open a session; what the
        resource answers.

        @raise Refused: 400, a malformed body; 429, too many failures; 503,
            too many checks at once.
        """
        if not callable(getattr(request, "addCookie", None)):
            raise Refused(400, "log in with POST /api/v1/login over HTTPS, not over the watch stream")
        name, password = body.get("user"), body.get("password")
        if not isinstance(name, str) or not isinstance(password, str) or set(body) - {"user", "password"}:
            raise Refused(400, 'a login is {"user": NAME, "password": PASSWORD}, both strings')
        if len(name) > 200 or len(password) > MAX_PASSWORD:
            raise Refused(400, "the user name or password is too long")
        host = getattr(request.getClientAddress(), "host", None) or client_address(request)
        who = f"{client_address(request)} as user {name!r}"
        wait = self._limited(host, name)
        if wait is not None:
            log.warn("admin API: login refused for {who}: over {n} failures a minute", who=who, n=MAX_FAILURES)
            raise Refused(429, f"too many failed logins from this address or for this user; "
                               f"try again in {math.ceil(wait)} s",
                          headers={b"retry-after": str(max(1, math.ceil(wait))).encode("ascii")})
        if self.verifying >= MAX_VERIFYING:
            raise Refused(503, "too many logins being checked at once; try again in a second",
                          headers={b"retry-after": b"1"})
        self.users.refresh()
        user = self.users.book.get(name)
        self.verifying += 1
        d = self.run_in_thread(verify_password, user, password)

        def checked(ok: bool) -> Deferred[dict[str, Any]]:
            self.verifying -= 1
            if not ok or user is None:
                self.by_address.failed(host)
                self.by_user.failed(name)
                log.warn("admin API: failed login from {who}", who=who)
                raise Refused(401, "wrong user name or password")
            return self._opened(request, user, log, who)

        def broke(f: Any) -> Any:
            self.verifying -= 1
            return f

        d.addCallbacks(checked, broke)
        return d

    def _opened(self, request: Any, user: User, log: Logger, who: str) -> Deferred[dict[str, Any]]:
        host = getattr(request.getClientAddress(), "host", None) or client_address(request)
        self.by_address.succeeded(host)
        self.by_user.succeeded(user.name)
        d = self.sessions.opening(user.name, user.role, stamp_of(user.role, user.hash))
        return d.addCallback(self._answer, request, user, log, who)

    def _answer(self, session: Session, request: Any, user: User, log: Logger, who: str) -> dict[str, Any]:
        request.addCookie(COOKIE, session.id.encode("ascii"), path=b"/", secure=True, httpOnly=True,
                          sameSite=b"strict", max_age=str(int(self.sessions.lifetime)).encode("ascii"))
        log.info("admin API: {who} logged in (role {role})", who=who, role=user.role)
        return {"user": user.name, "role": user.role, "csrf": session.csrf}

    def logout(self, request: Any, log: Logger) -> dict[str, Any]:
        session = session_of(request)
        if session is None:
            raise Refused(400, "there is no session to log out of (this client has a certificate)")
        self.sessions.close(session.id)
        request.addCookie(COOKIE, b"", path=b"/", secure=True, httpOnly=True, sameSite=b"strict", max_age=b"0")
        log.info("admin API: user {user!r} at {client} logged out", user=session.user,
                 client=client_address(request))
        return {"logged_out": session.user}


class Login(AdminNode):
    """
    C{POST /api/v1/login}: a 404 where the API has no logins (loopback
    without TLS, or no users file).
    """

    def render_POST(self, request: Any) -> Any:  # noqa: N802
        logins: Logins | None = self.root.logins
        if logins is None:
            raise Refused(404, "this admin API has no logins (they are served with --admin-tls)")
        return logins.login(request, json_body(request, self.root.max_body), self.root.log)


class Logout(AdminNode):
    """
    C{POST /api/v1/logout}: ends the request's session.
    """

    def render_POST(self, request: Any) -> Any:  # noqa: N802
        logins: Logins | None = self.root.logins
        if logins is None:
            raise Refused(404, "this admin API has no logins (they are served with --admin-tls)")
        return logins.logout(request, self.root.log)
