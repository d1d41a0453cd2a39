"""
Join tokens, users and sessions of an HA control plane, kept in etcd
(L{llmgw.control.ha.sharedtokens}, L{llmgw.control.ha.sharedpeople}),
against the in-memory etcd: a use spent once however members race, a
revoke every member sees, users and sessions every member follows, and a
join refused, not let in uncounted, while etcd cannot be reached.
"""

from __future__ import annotations

import datetime
import json
from http.cookies import SimpleCookie
from pathlib import Path
from typing import Any

from treq.testing import StubTreq
from twisted.internet import defer
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from llmgw.api.v1 import agent_pb2 as pb
from llmgw.control.admin.api import AdminResource
from llmgw.control.admin.base import Refused
from llmgw.control.admin.login import Logins
from llmgw.control.core.jointokens import TokenFile, TokenRefused
from llmgw.control.core.users import MIN_LOG_N, User, UserError, hash_password
from llmgw.control.ha.sharedpeople import SharedSessions, SharedUsers, UserStore
from llmgw.control.ha.sharedtokens import SharedTokens, TokenStoreUnavailable
from llmgw.control.shell.joining import JoinAuthority
from llmgw.control.shell.metrics import make_registry
from llmgw.testing.fakeetcd import FakeEtcd
from llmgw.testing.fleet import sample_fleet
from llmgw.tlsconf.ca import CertificateAuthority
from llmgw.tlsconf.csr import new_request

NOW = 1_700_000_000.0
PREFIX = "/llmgw"


class PausedGets:
    """
    An etcd whose next C{get} answers only when the test says: the read a
    member made before another member's write, delivered after it.
    """

    def __init__(self, fake: FakeEtcd):
        self.fake = fake
        self.held: list[tuple[defer.Deferred[Any], defer.Deferred[Any]]] = []
        self.pause = True

    def get(self, key: bytes) -> defer.Deferred[Any]:
        if not self.pause:
            return self.fake.get(key)
        self.pause = False
        d: defer.Deferred[Any] = defer.Deferred()
        self.held.append((d, self.fake.get(key)))
        return d

    def release(self) -> None:
        for d, read in self.held:
            read.addCallback(d.callback)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.fake, name)


def _user(name: str, role: str = "viewer", mark: bytes = b"a") -> User:
    # Made by hand: these tests need no scrypt computed.
    return User(name, role, 15, 8, 1, mark * 16, mark * 32)


class SharedTokenTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.clock.advance(NOW)
        self.etcd = FakeEtcd(self.clock)
        self.members = [SharedTokens(self.etcd, PREFIX) for _ in range(3)]

    def create(self, uses: int) -> tuple[str, str]:
        token, secret = self.successResultOf(self.members[0].create(NOW, 3600, uses))
        return token.id, secret

    def used(self, tid: str) -> int:
        kv = self.etcd.kvs[b"/llmgw/join-tokens/" + tid.encode()]
        used: int = json.loads(kv.value)["used"]
        return used

    def test_stored_hashed(self) -> None:
        """A token is kept in etcd under the prefix with its secret's hash, never the secret."""
        tid, secret = self.create(2)
        value = self.etcd.kvs[b"/llmgw/join-tokens/" + tid.encode()].value
        self.assertNotIn(secret.encode(), value)
        self.assertEqual(json.loads(value)["uses"], 2)

    def test_uses_spent_across_members(self) -> None:
        """Ten uses spent through three members in turn; the eleventh is refused as used up on every member."""
        tid, secret = self.create(10)
        for i in range(10):
            self.successResultOf(self.members[i % 3].spend(tid, secret, f"n{i}", NOW))
        self.assertEqual(self.used(tid), 10)
        for member in self.members:
            f = self.failureResultOf(member.spend(tid, secret, "n10", NOW), TokenRefused)
            self.assertIn("used up", f.getErrorMessage())
        self.assertEqual(self.used(tid), 10)

    def test_race_for_the_last_use(self) -> None:
        """Two members spend the last use at once: the one whose read is stale loses the compare, reads again and is refused; one use counted."""
        tid, secret = self.create(1)
        paused = PausedGets(self.etcd)
        slow = SharedTokens(paused, PREFIX)
        d = slow.spend(tid, secret, "a", NOW)
        self.assertNoResult(d)
        self.successResultOf(self.members[1].spend(tid, secret, "b", NOW))
        paused.release()
        f = self.failureResultOf(d, TokenRefused)
        self.assertIn("used up", f.getErrorMessage())
        self.assertEqual(slow.raced, 1)
        self.assertEqual(self.used(tid), 1)

    def test_revoke_seen_by_all(self) -> None:
        """A token revoked through one member (or `ctl token revoke --etcd`) is refused by every other."""
        tid, secret = self.create(5)
        self.successResultOf(self.members[2].revoke(tid))
        for member in self.members:
            f = self.failureResultOf(member.check(tid, secret, "n1", NOW), TokenRefused)
            self.assertIn("revoked", f.getErrorMessage())
        self.assertEqual([t["state"] for t in self.successResultOf(self.members[1].listing(NOW))], ["revoked"])

    def test_wrong_secret_and_unknown_alike(self) -> None:
        """A wrong secret, an unknown id and an id that is no id read alike."""
        tid, _ = self.create(1)
        for args in ((tid, "0" * 32), ("00000000", "x"), ("../../x", "x")):
            f = self.failureResultOf(self.members[0].check(*args, "n1", NOW), TokenRefused)
            self.assertIn("unknown or its secret is wrong", f.getErrorMessage())

    def test_unreachable(self) -> None:
        """With etcd unreachable a check and a spend fail with a clear error; nothing is counted."""
        tid, secret = self.create(1)
        self.etcd.available = False
        f = self.failureResultOf(self.members[0].spend(tid, secret, "n1", NOW), TokenStoreUnavailable)
        self.assertIn("join tokens live in etcd, which cannot be reached", f.getErrorMessage())
        self.etcd.available = True
        self.assertEqual(self.used(tid), 0)


class SharedJoinTests(SynchronousTestCase):
    """The join authority of a member whose tokens are etcd's."""

    def setUp(self) -> None:
        self.dir = Path(self.mktemp())
        self.ca = CertificateAuthority.init(self.dir)
        self.clock = Clock()
        self.clock.advance(NOW)
        self.etcd = FakeEtcd(self.clock)
        self.store = SharedTokens(self.etcd, PREFIX)

    def authority(self, signer: bool = True) -> JoinAuthority:
        auth = JoinAuthority(
            self.clock, TokenFile(None), lambda: list(CertificateAuthority.load(self.dir).roots),
            lambda n: False, signer_dir=self.dir if signer else None, lifetime=datetime.timedelta(minutes=5))
        auth.shared = SharedTokens(self.etcd, PREFIX)
        return auth

    def join(self, auth: JoinAuthority, tid: str, secret: str, name: str) -> pb.JoinResponse:
        req = pb.JoinRequest(token_id=tid, token_secret=secret, node_id=name, csr_pem=new_request(name)[1])
        return self.successResultOf(auth.answer(req, "10.0.0.9:5000"))

    def test_joins_on_two_members_share_the_uses(self) -> None:
        """Two members issue under one token of two uses; a third join, on either, is refused as used up."""
        token, secret = self.successResultOf(self.store.create(NOW, 3600, 2))
        a, b = self.authority(), self.authority()
        self.assertEqual(self.join(a, token.id, secret, "n1").status, pb.JoinResponse.STATUS_ISSUED)
        self.assertEqual(self.join(b, token.id, secret, "n2").status, pb.JoinResponse.STATUS_ISSUED)
        for auth in (a, b):
            r = self.join(auth, token.id, secret, "n3")
            self.assertEqual(r.status, pb.JoinResponse.STATUS_REFUSED)
            self.assertIn("used up", r.error)
        listed = self.successResultOf(self.store.listing(NOW))
        self.assertEqual((listed[0]["used"], listed[0]["nodes"]), (2, ["n1", "n2"]))

    def test_refused_while_etcd_unreachable(self) -> None:
        """With etcd unreachable a join is refused with an error that says so, no certificate is issued, and no use is counted."""
        token, secret = self.successResultOf(self.store.create(NOW, 3600, 1))
        auth = self.authority()
        self.etcd.available = False
        r = self.join(auth, token.id, secret, "n1")
        self.assertEqual(r.status, pb.JoinResponse.STATUS_REFUSED)
        self.assertIn("etcd, which cannot be reached", r.error)
        self.assertFalse(r.HasField("issued"))
        self.etcd.available = True
        self.assertEqual(self.successResultOf(self.store.listing(NOW))[0]["used"], 0)
        self.assertEqual(self.join(auth, token.id, secret, "n1").status, pb.JoinResponse.STATUS_ISSUED)

    def test_pending_without_signer_spends_a_use(self) -> None:
        """Without a signer a join waits for an operator and its use is counted in etcd."""
        token, secret = self.successResultOf(self.store.create(NOW, 3600, 1))
        auth = self.authority(signer=False)
        self.assertEqual(self.join(auth, token.id, secret, "n1").status, pb.JoinResponse.STATUS_PENDING)
        self.assertEqual(self.successResultOf(self.store.listing(NOW))[0]["used"], 1)
        self.assertEqual([p["node"] for p in auth.listing()], ["n1"])


class SharedUserTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.etcd = FakeEtcd(self.clock)
        self.store = UserStore(self.etcd, PREFIX)
        self.members = [SharedUsers(self.clock, self.etcd, PREFIX) for _ in range(2)]
        for m in self.members:
            m.mirror.start()

    def test_added_changed_removed_everywhere(self) -> None:
        """A user added, given a new password and removed in etcd is seen so by every member's copy."""
        self.successResultOf(self.store.add(_user("ann", "operator")))
        for m in self.members:
            user = m.book.get("ann")
            assert user is not None
            self.assertEqual((user.role, user.hash), ("operator", b"a" * 32))
        self.successResultOf(self.store.replace(_user("ann", "operator", b"b")))
        self.assertEqual([m.book.users["ann"].hash for m in self.members], [b"b" * 32] * 2)
        self.successResultOf(self.store.remove("ann"))
        self.assertEqual([m.book.get("ann") for m in self.members], [None, None])

    def test_taken_name_and_unknown(self) -> None:
        """Adding a name that exists is refused; changing or removing an unknown one is a KeyError."""
        self.successResultOf(self.store.add(_user("ann")))
        self.failureResultOf(self.store.add(_user("ann")), UserError)
        self.failureResultOf(self.store.replace(_user("bob")), KeyError)
        self.failureResultOf(self.store.remove("bob"), KeyError)
        self.assertEqual(self.successResultOf(self.store.listing()), [{"name": "ann", "role": "viewer"}])

    def test_late_member_and_outage(self) -> None:
        """A member started later reads the users already there; while etcd is away its copy stays, and it catches up after."""
        self.successResultOf(self.store.add(_user("ann")))
        late = SharedUsers(self.clock, self.etcd, PREFIX, retry_interval=1.0)
        self.etcd.available = False
        late.mirror.start()
        self.assertIsNone(late.book.get("ann"))
        self.assertIn("could be reached", late.mirror.last_error)
        self.etcd.available = True
        self.clock.advance(1.0)
        self.assertIsNotNone(late.book.get("ann"))


class SharedSessionTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.clock.advance(NOW)
        self.etcd = FakeEtcd(self.clock)
        self.a, self.b = (SharedSessions(self.clock, self.etcd, PREFIX, lifetime=600.0, idle=300.0)
                          for _ in range(2))
        for m in (self.a, self.b):
            m.mirror.start()

    def test_session_holds_on_another_member(self) -> None:
        """A session opened on one member is found on another with its user, role, stamp and CSRF token; the cookie is not a key in etcd."""
        s = self.successResultOf(self.a.opening("ann", "operator", b"stamp"))
        found = self.b.find(s.id)
        assert found is not None
        self.assertEqual((found.user, found.role, found.stamp, found.csrf), ("ann", "operator", b"stamp", s.csrf))
        self.assertFalse(any(s.id.encode() in k or s.id.encode() in kv.value for k, kv in self.etcd.kvs.items()))

    def test_logout_ends_it_everywhere(self) -> None:
        """A session closed on one member is gone on the other."""
        s = self.successResultOf(self.a.opening("ann", "viewer", b"x"))
        self.b.close(s.id)
        self.assertIsNone(self.a.find(s.id))
        self.assertEqual(len(self.a), 0)

    def test_idle_limit_is_a_lease_kept_by_use_anywhere(self) -> None:
        """A session used on another member than its own outlives the idle limit; unused that long, etcd ends it on every member."""
        self.a.lifetime = self.b.lifetime = 3600.0
        s = self.successResultOf(self.a.opening("ann", "viewer", b"x"))
        for _ in range(10):
            self.clock.advance(100.0)
            self.assertIsNotNone(self.b.find(s.id))
        self.clock.advance(301.0)
        self.assertEqual(self.etcd.kvs, {})
        self.assertIsNone(self.a.find(s.id))
        self.assertIsNone(self.b.find(s.id))

    def test_lifetime_ends_it_however_used(self) -> None:
        """A session used all along ends at its lifetime, and is deleted from etcd then."""
        s = self.successResultOf(self.a.opening("ann", "viewer", b"x"))
        for _ in range(5):
            self.clock.advance(100.0)
            self.assertIsNotNone(self.b.find(s.id))
        self.clock.advance(100.0)
        self.assertIsNone(self.b.find(s.id))
        self.assertEqual(self.etcd.kvs, {})
        self.assertIsNone(self.a.find(s.id))

    def test_unreachable_login_refused(self) -> None:
        """With etcd unreachable no session is opened: the login is a 503."""
        self.etcd.available = False
        f = self.failureResultOf(self.a.opening("ann", "viewer", b"x"), Refused)
        self.assertEqual(f.value.status, 503)


class LoginsAcrossMembersTests(SynchronousTestCase):
    """Two members' admin APIs, with logins whose users and sessions are etcd's."""

    def setUp(self) -> None:
        self.clock = Clock()
        self.etcd = FakeEtcd(self.clock)
        self.store = UserStore(self.etcd, PREFIX)
        self.successResultOf(self.store.add(hash_password("otto", "operator", "operator-password", log_n=MIN_LOG_N)))
        self.apis = []
        for _ in range(2):
            users = SharedUsers(self.clock, self.etcd, PREFIX)
            sessions = SharedSessions(self.clock, self.etcd, PREFIX)
            logins = Logins(users, self.clock, run_in_thread=defer.maybeDeferred, sessions=sessions)
            users.mirror.start()
            sessions.mirror.start()
            self.apis.append(StubTreq(AdminResource(sample_fleet(), make_registry(), require_certificate=True,
                                                    logins=logins)))

    def call(self, member: int, method: str, path: str, body: Any = None,
             cookie: str | None = None) -> tuple[int, Any, Any]:
        api = self.apis[member]
        headers: dict[str, list[str]] = {"Content-Type": ["application/json"]}
        if cookie is not None:
            headers["Cookie"] = [f"llmgw_session={cookie}"]
        data = json.dumps(body).encode() if body is not None else None
        d = api.request(method, "http://127.0.0.1:7480" + path, headers=headers, data=data)
        api.flush()
        response = self.successResultOf(d)
        content = self.successResultOf(api.content(response))
        return response.code, json.loads(content), response.headers

    def test_session_of_one_member_holds_on_the_other_until_the_password_changes(self) -> None:
        """A login on one member reads on the other; a new password set in etcd ends it on both."""
        code, body, headers = self.call(0, "POST", "/api/v1/login", {"user": "otto", "password": "operator-password"})
        self.assertEqual(code, 200, body)
        cookie: SimpleCookie = SimpleCookie()
        cookie.load(headers.getRawHeaders(b"set-cookie")[0].decode())
        sid = cookie["llmgw_session"].value
        code, who, _ = self.call(1, "GET", "/api/v1/whoami", cookie=sid)
        self.assertEqual(code, 200, who)
        self.successResultOf(self.store.replace(hash_password("otto", "operator", "new-password", log_n=MIN_LOG_N)))
        for member in (0, 1):
            self.assertEqual(self.call(member, "GET", "/api/v1/nodes", cookie=sid)[0], 401)
            code, who, _ = self.call(member, "GET", "/api/v1/whoami", cookie=sid)
            self.assertEqual((code, who["role"]), (200, None), who)
        code, body, _ = self.call(1, "POST", "/api/v1/login", {"user": "otto", "password": "new-password"})
        self.assertEqual(code, 200, body)
