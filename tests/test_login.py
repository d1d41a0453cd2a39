"""
Login for people on an admin API that asks for certificates
(L{llmgw.control.admin.login}), through the admin API's whole tree in
memory: users and their hashes (L{llmgw.control.core.users}), sessions and
their expiry on a Clock, CSRF tokens on writes, failed logins limited per
address and per user, roles enforced by the API, and log lines without
passwords; and C{llmgw ctl user}.
"""

from __future__ import annotations

import argparse
import io
import json
from collections.abc import Callable
from http.cookies import SimpleCookie
from pathlib import Path
from typing import Any

from treq.testing import StubTreq
from twisted.internet.defer import Deferred, maybeDeferred
from twisted.internet.task import Clock
from twisted.logger import Logger, formatEvent
from twisted.trial.unittest import SynchronousTestCase

from llmgw.control.admin.api import AdminResource
from llmgw.control.admin.login import MAX_VERIFYING, Logins
from llmgw.control.admin.sessions import FailureLimit, SessionBook
from llmgw.control.core.users import (
    MIN_LOG_N,
    SCRYPT_LOG_N,
    UserBook,
    UserError,
    UserFile,
    hash_password,
    verify_password,
)
from llmgw.control.shell.metrics import make_registry
from llmgw.ctl import user as ctl_user
from llmgw.ctl.main import build_parser
from llmgw.testing.fleet import sample_fleet

BASE = "http://127.0.0.1:7480"
PASSWORDS = {"vera": "viewer-password", "otto": "operator-password", "ada": "admin-password"}
ROLES = {"vera": "viewer", "otto": "operator", "ada": "admin"}


def _users(path: Path) -> UserFile:
    users = UserFile(path)
    for name, password in PASSWORDS.items():
        # The cheapest parameters a file may hold, to keep the tests quick.
        users.book.add(hash_password(name, ROLES[name], password, log_n=MIN_LOG_N))
    users.save()
    return users


class HashTests(SynchronousTestCase):
    def test_hash_and_verify(self) -> None:
        """
        A password verifies against its own hash and no other; each hash has
        its own salt; the default parameters are scrypt's N=2**15, r=8, p=1;
        an unknown user never verifies.
        """
        a = hash_password("ann", "viewer", "correct horse")
        b = hash_password("bob", "viewer", "correct horse")
        self.assertEqual((a.log_n, a.r, a.p), (SCRYPT_LOG_N, 8, 1))
        self.assertNotEqual(a.salt, b.salt)
        self.assertNotEqual(a.hash, b.hash)
        self.assertTrue(verify_password(a, "correct horse"))
        self.assertFalse(verify_password(a, "correct horsE"))
        self.assertFalse(verify_password(None, "correct horse"))

    def test_refused_users(self) -> None:
        """
        Short passwords, unknown roles and names that are no node-id-like
        names are refused when set, each with a message saying which.
        """
        with self.assertRaises(UserError) as e:
            hash_password("ann", "viewer", "short", log_n=MIN_LOG_N)
        self.assertIn("at least 8", str(e.exception))
        with self.assertRaises(UserError) as e:
            hash_password("ann", "root", "long enough", log_n=MIN_LOG_N)
        self.assertIn("viewer, operator, admin", str(e.exception))
        with self.assertRaises(UserError):
            hash_password("Ann Smith", "viewer", "long enough", log_n=MIN_LOG_N)

    def test_file_round_trip_and_weak_parameters(self) -> None:
        """
        The file keeps the parameters and salt beside each hash (mode 0600)
        and verifies after a reload; a user edited to weaker parameters than
        the least allowed is skipped, not trusted.
        """
        path = Path(self.mktemp())
        path.parent.mkdir(parents=True, exist_ok=True)
        users = _users(path)
        self.assertEqual(path.stat().st_mode & 0o777, 0o600)
        again = UserFile(path)
        again.load()
        self.assertEqual(again.book.listing(), users.book.listing())
        self.assertTrue(verify_password(again.book.get("vera"), "viewer-password"))
        data = json.loads(path.read_text())
        self.assertNotIn("viewer-password", path.read_text())
        data["users"][0]["log_n"] = 4
        book = UserBook()
        warnings = book.take_data(data)
        self.assertEqual(len(book.users), 2)
        self.assertIn("out of range", warnings[0])


class LoginTestCase(SynchronousTestCase):
    """
    The admin tree as served over TLS (certificates required) with logins,
    the password checks run by L{run} when the test says.
    """

    def setUp(self) -> None:
        self.clock = Clock()
        path = Path(self.mktemp())
        path.parent.mkdir(parents=True, exist_ok=True)
        self.users = _users(path)
        #: Checks handed to the thread: (function, args, their Deferred).
        self.queued: list[tuple[Callable[..., Any], tuple[Any, ...], Deferred[Any]]] = []
        self.run_at_once = True
        self.logins = Logins(self.users, self.clock, run_in_thread=self.in_thread)
        self.fleet = sample_fleet()
        self.resource = AdminResource(self.fleet, make_registry(), require_certificate=True, logins=self.logins)
        self.logged: list[dict[str, Any]] = []
        self.resource.log = Logger(observer=self.logged.append)  # type: ignore[arg-type]
        self.treq: Any = StubTreq(self.resource)

    def in_thread(self, f: Callable[..., Any], *args: Any) -> Deferred[Any]:
        if self.run_at_once:
            return maybeDeferred(f, *args)
        d: Deferred[Any] = Deferred()
        self.queued.append((f, args, d))
        return d

    def call(self, method: str, path: str, body: Any = None, cookie: str | None = None,
             csrf: str | None = None) -> tuple[int, Any, Any]:
        headers: dict[str, list[str]] = {}
        if method == "POST":
            headers["Content-Type"] = ["application/json"]
        if cookie is not None:
            headers["Cookie"] = [f"llmgw_session={cookie}"]
        if csrf is not None:
            headers["X-CSRF-Token"] = [csrf]
        data = json.dumps(body).encode() if body is not None else (b"{}" if method == "POST" else None)
        d = self.treq.request(method, BASE + path, headers=headers, data=data)
        self.treq.flush()
        response = self.successResultOf(d)
        content = self.successResultOf(self.treq.content(response))
        return response.code, json.loads(content) if content.startswith(b"{") else content, response.headers

    def login(self, name: str, password: str | None = None) -> tuple[str, str]:
        """
        Log in as C{name}; the session's cookie and CSRF token.
        """
        code, body, headers = self.call("POST", "/api/v1/login",
                                        {"user": name, "password": password or PASSWORDS[name]})
        self.assertEqual(code, 200, body)
        cookie: SimpleCookie = SimpleCookie()
        cookie.load(headers.getRawHeaders(b"set-cookie")[0].decode())
        return cookie["llmgw_session"].value, body["csrf"]

    def messages(self) -> list[str]:
        return [formatEvent(e) for e in self.logged]


class LoginTests(LoginTestCase):
    def test_without_certificate_or_session(self) -> None:
        """
        Without a certificate or a session, the API is a 401 that says how
        to log in; the page's files and the login are served.
        """
        code, body, _ = self.call("GET", "/api/v1/nodes")
        self.assertEqual(code, 401)
        self.assertIn("POST /api/v1/login", body["error"])
        self.assertEqual(self.call("GET", "/page/page.js")[0], 200)
        self.assertEqual(self.call("GET", "/")[0], 200)
        self.assertEqual(self.call("POST", "/api/v1/nodes/gpu-1/cordon")[0], 401)
        self.assertEqual(self.fleet.calls, [])

    def test_login_cookie_and_whoami(self) -> None:
        """
        A login sets an HttpOnly, Secure, SameSite=Strict cookie with a
        random id; with it the user reads, and C{whoami} names the user, the
        role and the session's CSRF token.
        """
        code, body, headers = self.call("POST", "/api/v1/login", {"user": "vera", "password": PASSWORDS["vera"]})
        self.assertEqual(code, 200)
        self.assertEqual((body["user"], body["role"]), ("vera", "viewer"))
        raw = headers.getRawHeaders(b"set-cookie")[0].decode()
        for attribute in ("HttpOnly", "Secure", "SameSite=strict", "Path=/"):
            self.assertIn(attribute.lower(), raw.lower())
        cookie: SimpleCookie = SimpleCookie()
        cookie.load(raw)
        sid = cookie["llmgw_session"].value
        self.assertGreaterEqual(len(sid), 40)
        code, who, _ = self.call("GET", "/api/v1/whoami", cookie=sid)
        self.assertEqual((who["name"], who["role"], who["csrf"]), ("vera", "viewer", body["csrf"]))
        self.assertEqual(self.call("GET", "/api/v1/nodes", cookie=sid)[0], 200)
        self.assertIn("admin API: 127.0.0.1", " ".join(self.messages()).replace("'", ""))

    def test_whoami_without_a_session_names_no_one(self) -> None:
        """
        Without a certificate or a session, C{whoami} answers 200 with no
        role and C{login}: the page learns it must log in without an error
        in the browser's console; every other read is still a 401.
        """
        code, who, _ = self.call("GET", "/api/v1/whoami")
        self.assertEqual(code, 200)
        self.assertEqual((who["name"], who["role"], who["login"]), (None, None, True))
        self.assertEqual(self.call("GET", "/api/v1/nodes")[0], 401)
        code, who, _ = self.call("GET", "/api/v1/whoami", cookie="no-such-session")
        self.assertEqual((code, who["role"]), (200, None))

    def test_password_checked_off_the_reactor(self) -> None:
        """
        The password is checked by what runs in a thread, never while the
        request is being handled: the answer waits for it.
        """
        self.run_at_once = False
        d = self.treq.request("POST", BASE + "/api/v1/login", headers={"Content-Type": ["application/json"]},
                              data=json.dumps({"user": "otto", "password": PASSWORDS["otto"]}).encode())
        self.treq.flush()
        self.assertNoResult(d)
        [(f, args, waiting)] = self.queued
        self.assertIs(f, verify_password)
        waiting.callback(f(*args))
        self.treq.flush()
        self.assertEqual(self.successResultOf(d).code, 200)

    def test_checks_at_once_bounded(self) -> None:
        """
        Past L{MAX_VERIFYING} password checks in flight, a login is a 503
        with C{Retry-After}, before any hash is computed.
        """
        self.run_at_once = False
        for _ in range(MAX_VERIFYING):
            self.treq.request("POST", BASE + "/api/v1/login", headers={"Content-Type": ["application/json"]},
                              data=json.dumps({"user": "otto", "password": "whatever-it-is"}).encode())
        self.treq.flush()
        code, body, headers = self.call("POST", "/api/v1/login", {"user": "otto", "password": "x" * 9})
        self.assertEqual(code, 503)
        self.assertEqual(headers.getRawHeaders(b"retry-after"), [b"1"])
        self.assertEqual(len(self.queued), MAX_VERIFYING)

    def test_wrong_password_logged_without_it(self) -> None:
        """
        A wrong password is a 401 that does not say whether the user
        exists, logged with the address and the user's name, never the
        password tried.
        """
        code, body, _ = self.call("POST", "/api/v1/login", {"user": "otto", "password": "guess-number-one"})
        self.assertEqual(code, 401)
        code, body2, _ = self.call("POST", "/api/v1/login", {"user": "nobody", "password": "guess-number-two"})
        self.assertEqual((code, body2["error"]), (401, body["error"]))
        text = "\n".join(self.messages())
        self.assertIn("failed login from 127.0.0.1", text)
        self.assertIn("'otto'", text)
        self.assertNotIn("guess-number", text)

    def test_malformed_login(self) -> None:
        """
        A login body that is not a user and a password, both strings, is a
        400 that says what one is.
        """
        for body in ({"user": "otto"}, {"user": 1, "password": "x"}, {"user": "otto", "password": "x", "more": 1}):
            code, answer, _ = self.call("POST", "/api/v1/login", body)
            self.assertEqual(code, 400, body)
            self.assertIn('"user": NAME', answer["error"])


class RateLimitTests(LoginTestCase):
    def fail(self, name: str, n: int = 5) -> None:
        for i in range(n):
            self.assertEqual(self.call("POST", "/api/v1/login", {"user": name, "password": f"wrong-{i}"})[0], 401)

    def test_per_user(self) -> None:
        """
        After five failures for a user within a minute, that user's next
        login is a 429 with C{Retry-After}, even with the right password,
        from any address; another user is not held back; a minute later the
        user may try again.
        """
        self.fail("otto")
        self.logins.by_address = FailureLimit(self.clock)  # as if from elsewhere
        code, body, headers = self.call("POST", "/api/v1/login", {"user": "otto", "password": PASSWORDS["otto"]})
        self.assertEqual(code, 429)
        self.assertEqual(headers.getRawHeaders(b"retry-after"), [b"60"])
        self.login("vera")
        self.clock.advance(61)
        self.login("otto")

    def test_per_address(self) -> None:
        """
        After five failures from one address within a minute, any user's
        login from there is a 429, logged with the address and the name.
        """
        for i, name in enumerate(("a1", "a2", "a3", "a4", "a5")):
            self.call("POST", "/api/v1/login", {"user": name, "password": f"wrong-{i}"})
        code, body, _ = self.call("POST", "/api/v1/login", {"user": "vera", "password": PASSWORDS["vera"]})
        self.assertEqual(code, 429)
        self.assertIn("too many failed logins", body["error"])
        self.assertIn("login refused for 127.0.0.1", "\n".join(self.messages()))

    def test_limit_unit(self) -> None:
        """
        L{FailureLimit} counts failures in a sliding window, says how long
        until the oldest leaves it, and forgets a key that succeeded.
        """
        limit = FailureLimit(self.clock, max_failures=2, window=10)
        limit.failed("k")
        self.clock.advance(4)
        limit.failed("k")
        self.assertEqual(limit.retry_after("k"), 6)
        self.clock.advance(6)
        self.assertIsNone(limit.retry_after("k"))
        limit.failed("k")
        limit.succeeded("k")
        self.assertIsNone(limit.retry_after("k"))


class SessionTests(LoginTestCase):
    def test_idle_and_lifetime(self) -> None:
        """
        A session unused for an hour ends; one used all along ends after
        twelve hours; an ended one is a 401.
        """
        sid, _ = self.login("vera")
        self.clock.advance(3599)
        self.assertEqual(self.call("GET", "/api/v1/nodes", cookie=sid)[0], 200)
        self.clock.advance(3600)
        self.assertEqual(self.call("GET", "/api/v1/nodes", cookie=sid)[0], 401)
        sid, _ = self.login("vera")
        for _ in range(14):  # 42,000 s, each step within the idle hour
            self.clock.advance(3000)
            self.assertEqual(self.call("GET", "/api/v1/nodes", cookie=sid)[0], 200)
        self.clock.advance(3000)
        self.assertEqual(self.call("GET", "/api/v1/nodes", cookie=sid)[0], 401)

    def test_bounded(self) -> None:
        """
        The book holds at most its bound; the session unused longest goes.
        """
        book = SessionBook(self.clock, max_sessions=2)
        a = book.open("a", "viewer", b"")
        self.clock.advance(1)
        b = book.open("b", "viewer", b"")
        self.clock.advance(1)
        book.find(a.id)
        book.open("c", "viewer", b"")
        self.assertEqual(len(book), 2)
        self.assertIsNone(book.find(b.id))
        self.assertIsNotNone(book.find(a.id))

    def test_logout_removal_and_new_password_end_it(self) -> None:
        """
        Logging out ends the session; so does removing its user or giving
        them another password (the file changed by C{llmgw ctl user}).
        """
        sid, csrf = self.login("otto")
        self.assertEqual(self.call("POST", "/api/v1/logout", cookie=sid, csrf=csrf)[0], 200)
        self.assertEqual(self.call("GET", "/api/v1/nodes", cookie=sid)[0], 401)
        sid, _ = self.login("otto")
        other = UserFile(self.users.path)
        other.load()
        other.book.replace(hash_password("otto", "operator", "a-new-password", log_n=MIN_LOG_N))
        other.save()
        self.assertEqual(self.call("GET", "/api/v1/nodes", cookie=sid)[0], 401)
        sid, _ = self.login("vera")
        other.book.remove("vera")
        other.save()
        self.assertEqual(self.call("GET", "/api/v1/nodes", cookie=sid)[0], 401)

    def test_viewer_logs_out(self) -> None:
        """
        A viewer, who may write nothing, may still end their own session
        (with its CSRF token); without the token it is refused.
        """
        sid, csrf = self.login("vera")
        self.assertEqual(self.call("POST", "/api/v1/logout", cookie=sid)[0], 403)
        self.assertEqual(self.call("POST", "/api/v1/logout", cookie=sid, csrf=csrf)[0], 200)
        self.assertEqual(self.call("GET", "/api/v1/nodes", cookie=sid)[0], 401)


class WriteTests(LoginTestCase):
    def test_csrf_required_on_writes(self) -> None:
        """
        An operator's write with its session but without the CSRF token, or
        with another, is a 403 and changes nothing; with it, it is done.
        """
        sid, csrf = self.login("otto")
        code, body, _ = self.call("POST", "/api/v1/nodes/gpu-1/cordon", cookie=sid)
        self.assertEqual(code, 403)
        self.assertIn("X-CSRF-Token", body["error"])
        self.assertEqual(self.call("POST", "/api/v1/nodes/gpu-1/cordon", cookie=sid, csrf="forged")[0], 403)
        self.assertEqual(self.fleet.calls, [])
        self.assertEqual(self.call("POST", "/api/v1/nodes/gpu-1/cordon", cookie=sid, csrf=csrf)[0], 200)
        self.assertEqual(self.fleet.calls, [("cordon", "gpu-1")])

    def test_roles_enforced(self) -> None:
        """
        A viewer's write, with its CSRF token, is a 403 naming the role; an
        admin user may write as an operator may.
        """
        sid, csrf = self.login("vera")
        code, body, _ = self.call("POST", "/api/v1/nodes/gpu-1/drain", cookie=sid, csrf=csrf)
        self.assertEqual(code, 403)
        self.assertIn("role viewer", body["error"])
        self.assertEqual(self.fleet.calls, [])
        sid, csrf = self.login("ada")
        self.assertEqual(self.call("POST", "/api/v1/nodes/gpu-1/drain", cookie=sid, csrf=csrf)[0], 200)
        self.assertEqual(self.fleet.calls, [("drain", "gpu-1")])
        self.assertIn("user ada (admin) at 127.0.0.1", "\n".join(self.messages()))


class CtlUserTests(SynchronousTestCase):
    def run_ctl(self, *argv: str, stdin: str = "") -> tuple[int, str, str]:
        args = build_parser().parse_args(["ctl", "user", "--certs", self.dir, *argv])
        out, err = io.StringIO(), io.StringIO()
        kwargs: dict[str, Any] = {}
        if args.func in (ctl_user.cmd_add, ctl_user.cmd_passwd):
            kwargs["stdin"] = io.StringIO(stdin)
        return int(args.func(args, out=out, err=err, **kwargs)), out.getvalue(), err.getvalue()

    def setUp(self) -> None:
        self.dir = self.mktemp()
        Path(self.dir).mkdir()

    def test_add_list_passwd_remove(self) -> None:
        """
        C{ctl user add} reads the password from standard input (not a
        terminal) or C{--password-file}; C{list} shows names and roles, never
        hashes; C{passwd} changes it; C{remove} removes the user.
        """
        self.assertEqual(self.run_ctl("add", "vera", "--role", "viewer", stdin="first-password\n")[0], 0)
        pw = Path(self.dir) / "pw"
        pw.write_text("second-password\n")
        self.assertEqual(self.run_ctl("add", "otto", "--role", "operator", "--password-file", str(pw))[0], 0)
        code, out, _ = self.run_ctl("list", "--json")
        self.assertEqual(json.loads(out), [{"name": "otto", "role": "operator"}, {"name": "vera", "role": "viewer"}])
        users = UserFile(Path(self.dir) / "users.json")
        users.load()
        self.assertTrue(verify_password(users.book.get("otto"), "second-password"))
        self.assertEqual(self.run_ctl("passwd", "vera", stdin="third-password\n")[0], 0)
        users.load()
        self.assertTrue(verify_password(users.book.get("vera"), "third-password"))
        self.assertEqual(self.run_ctl("remove", "vera")[0], 0)
        code, _, err = self.run_ctl("remove", "vera")
        self.assertEqual(code, 1)
        self.assertIn("no user 'vera'", err)

    def test_refusals(self) -> None:
        """
        A short password, an existing user and an unknown role are refused
        with a message, and the file is not written.
        """
        code, _, err = self.run_ctl("add", "vera", "--role", "viewer", stdin="short\n")
        self.assertEqual(code, 2)
        self.assertIn("at least 8", err)
        self.assertFalse((Path(self.dir) / "users.json").exists())
        self.run_ctl("add", "vera", "--role", "viewer", stdin="long-enough\n")
        code, _, err = self.run_ctl("add", "vera", "--role", "viewer", stdin="long-enough\n")
        self.assertEqual((code, "exists" in err), (2, True))
        with self.assertRaises(SystemExit):
            build_parser().parse_args(["ctl", "user", "add", "x", "--role", "root"])

    def test_password_from_terminal_twice(self) -> None:
        """
        On a terminal the password is asked twice, and two that differ are
        refused.
        """
        answers = iter(["one-password", "another-one"])
        self.patch(ctl_user.getpass, "getpass", lambda prompt: next(answers))

        class Tty(io.StringIO):
            def isatty(self) -> bool:
                return True

        args = argparse.Namespace(password_file=None)
        with self.assertRaises(UserError):
            ctl_user.read_password(args, Tty())


