"""
Browser sessions of the admin API and the limit on failed logins: both
kept in memory, bounded, and timed by an injected clock.

A session is a random id (the cookie), the user it was opened for, the
role and password stamp the user had then, and a CSRF token every write
must repeat. It ends after L{SESSION_LIFETIME}, after L{SESSION_IDLE}
unused, at logout, or when its user is removed, given another role or
another password (the caller compares the stamp).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections import OrderedDict, deque
from dataclasses import dataclass

from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IReactorTime

#: How long a session lasts at most, and unused.
SESSION_LIFETIME = 12 * 3600.0
SESSION_IDLE = 3600.0
#: Sessions kept at most; the one unused the longest goes first.
MAX_SESSIONS = 1000
#: Failed logins one address, or one user name, may have in
#: L{FAILURE_WINDOW} seconds; past them it is refused until the oldest is
#: that old.
MAX_FAILURES = 5
FAILURE_WINDOW = 60.0
#: Addresses and names whose failures are kept at most (the oldest go).
MAX_FAILURE_KEYS = 10_000


@dataclass
class Session:
    """
    One logged-in browser. C{stamp} is a digest of the user's role and
    password hash when the session was opened (L{stamp_of}): another one
    since ends it.
    """

    id: str
    user: str
    role: str
    stamp: bytes
    csrf: str
    opened: float
    used: float

    def csrf_matches(self, token: str | bytes | None) -> bool:
        """
        Whether C{token} (a request's C{X-CSRF-Token}) is this session's,
        compared in constant time.
        """
        if token is None:
            return False
        raw = token.encode("latin-1") if isinstance(token, str) else token
        return hmac.compare_digest(raw, self.csrf.encode("ascii"))


def stamp_of(role: str, password_hash: bytes) -> bytes:
    """
    What a session keeps of its user: a digest that changes with the role
    and the password, so that the hash itself is kept nowhere else.
    """
    return hashlib.sha256(role.encode("utf-8") + b"\0" + password_hash).digest()


class SessionBook:
    """
    The open sessions, by id, at most C{max_sessions}.
    """

    def __init__(self, clock: IReactorTime, lifetime: float = SESSION_LIFETIME,
                 idle: float = SESSION_IDLE, max_sessions: int = MAX_SESSIONS):
        self.clock = clock
        self.lifetime = lifetime
        self.idle = idle
        self.max_sessions = max_sessions
        # Least recently used first.
        self._sessions: OrderedDict[str, Session] = OrderedDict()

    def __len__(self) -> int:
        return len(self._sessions)

    def open(self, user: str, role: str, stamp: bytes) -> Session:
        """
        A new session for C{user}; the least recently used one is closed
        when the book is full.
        """
        self._expire()
        while len(self._sessions) >= self.max_sessions:
            self._sessions.popitem(last=False)
        now = self.clock.seconds()
        session = Session(secrets.token_urlsafe(32), user, role, stamp, secrets.token_urlsafe(32), now, now)
        self._sessions[session.id] = session
        return session

    def opening(self, user: str, role: str, stamp: bytes) -> Deferred[Session]:
        """
        L{open}, as a Deferred: a book kept elsewhere (in etcd, for an HA
        control plane) answers once the session is kept there.
        """
        return succeed(self.open(user, role, stamp))

    def find(self, sid: str | None) -> Session | None:
        """
        The live session C{sid}, marked used now; C{None} for an unknown or
        ended one (an ended one is closed).
        """
        if not sid:
            return None
        session = self._sessions.get(sid)
        if session is None:
            return None
        now = self.clock.seconds()
        if now - session.opened >= self.lifetime or now - session.used >= self.idle:
            del self._sessions[sid]
            return None
        session.used = now
        self._sessions.move_to_end(sid)
        return session

    def close(self, sid: str) -> None:
        self._sessions.pop(sid, None)

    def _expire(self) -> None:
        now = self.clock.seconds()
        # Least recently used first: the idle ones are at the front.
        while self._sessions:
            sid, session = next(iter(self._sessions.items()))
            if now - session.used < self.idle:
                break
            del self._sessions[sid]


class FailureLimit:
    """
    Failed attempts per key (an address, a user name) in a sliding window:
    L{retry_after} says how long a key must wait once it has
    C{max_failures} in the last C{window} seconds.
    """

    def __init__(self, clock: IReactorTime, max_failures: int = MAX_FAILURES,
                 window: float = FAILURE_WINDOW, max_keys: int = MAX_FAILURE_KEYS):
        self.clock = clock
        self.max_failures = max_failures
        self.window = window
        self.max_keys = max_keys
        self._failures: OrderedDict[str, deque[float]] = OrderedDict()

    def _recent(self, key: str) -> deque[float] | None:
        times = self._failures.get(key)
        if times is None:
            return None
        cutoff = self.clock.seconds() - self.window
        while times and times[0] <= cutoff:
            times.popleft()
        if not times:
            del self._failures[key]
            return None
        return times

    def retry_after(self, key: str) -> float | None:
        """
        Seconds until C{key} may try again, or C{None} when it may now.
        """
        times = self._recent(key)
        if times is None or len(times) < self.max_failures:
            return None
        return max(times[0] + self.window - self.clock.seconds(), 0.0)

    def failed(self, key: str) -> None:
        """
        Count a failure of C{key} now.
        """
        times = self._recent(key)
        if times is None:
            while len(self._failures) >= self.max_keys:
                self._failures.popitem(last=False)
            times = self._failures[key] = deque(maxlen=self.max_failures)
        times.append(self.clock.seconds())
        self._failures.move_to_end(key)

    def succeeded(self, key: str) -> None:
        """
        Forget C{key}'s failures (it proved it knows the password).
        """
        self._failures.pop(key, None)
