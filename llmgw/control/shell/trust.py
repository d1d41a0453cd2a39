"""
The control plane's trust material while it runs: reloading the certificate,
key, CA and CRL without a restart (SIGHUP, or the admin API calling
L{TrustService.reload_tls}), closing streams a new CRL revokes, and keeping
expiry dates in sight (the log, and L{TrustService.expiry_snapshot} for
metrics).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Iterable
from typing import Any

from cryptography import x509
from OpenSSL import SSL
from twisted.application.service import Service
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger

from llmgw.control.core.certexpiry import ExpiryNotices
from llmgw.control.shell.agentsvc import AgentService
from llmgw.control.state.inventory import Inventory
from llmgw.signals import SighupHandler, owns_signals
from llmgw.tlsconf.crl import crl_number, revoked_serials
from llmgw.tlsconf.options import ServerTLS, TLSConfigError, TLSFiles

#: Certificates closer than this to their end are warned about.
WARN_BEFORE = datetime.timedelta(days=30)
#: How often expiry is checked (and logged when close) while running.
EXPIRY_CHECK_INTERVAL = 3600.0
#: At most this many nodes are named in one expiry warning; the rest are counted.
MAX_NODES_NAMED = 10


def _ts(when: datetime.datetime) -> float:
    return when.timestamp()


def expiry_snapshot(files: TLSFiles, agents: Iterable[tuple[str, float]]) -> dict[str, Any]:
    """
    Expiry dates as Unix seconds. See L{TrustService.expiry_snapshot} for
    the keys.
    """
    crl = files.crl
    reported: dict[str, float] = {}
    unreported = 0
    for node_id, not_after in agents:
        if not_after > 0:
            reported[node_id] = not_after
        else:
            unreported += 1
    roots = files.roots or (files.ca,)
    return {
        # The earliest: the date by which a rollover must be done.
        "ca_not_after": min(_ts(r.not_valid_after_utc) for r in roots),
        "ca_roots": len(roots),
        "server_not_after": _ts(files.cert.not_valid_after_utc),
        "server_serial": format(files.cert.serial_number, "x"),
        "crl_last_update": _ts(crl.last_update_utc) if crl is not None else None,
        "crl_next_update": (
            _ts(crl.next_update_utc) if crl is not None and crl.next_update_utc else None
        ),
        "crl_number": crl_number(crl) if crl is not None else None,
        "crl_revoked": len(revoked_serials(crl)) if crl is not None else 0,
        "agents_not_after": reported,
        "agents_unreported": unreported,
        "earliest_agent_not_after": min(reported.values()) if reported else None,
    }


def crl_warn_before(crl: x509.CertificateRevocationList) -> datetime.timedelta:
    """
    How close to its next-update a CRL is warned about: 30 days, or half its
    lifetime when that is shorter (a 30-day CRL would otherwise always be
    "about to expire").
    """
    nu = crl.next_update_utc
    if nu is None:
        return WARN_BEFORE
    return min(WARN_BEFORE, (nu - crl.last_update_utc) / 2)


def expiry_problems(
    files: TLSFiles, agents: Iterable[tuple[str, float]], now: datetime.datetime
) -> list[tuple[str, str]]:
    """
    What is expired or close to it, as C{(level, message)} with level
    C{"error"} (expired) or C{"warn"}.
    """
    out: list[tuple[str, str]] = []

    def check(what: str, end: datetime.datetime, before: datetime.timedelta, fix: str) -> None:
        left = end - now
        if left <= datetime.timedelta(0):
            out.append(("error", f"{what} expired on {end.isoformat()}; {fix}"))
        elif left < before:
            days = left.total_seconds() / 86400
            out.append(("warn", f"{what} expires in {days:.1f} days ({end.isoformat()}); {fix}"))

    roots = files.roots or (files.ca,)
    for root in roots:
        which = f" root {root.subject.rfc4514_string()}" if len(roots) > 1 else ""
        check(
            f"the CA certificate {files.ca_path}{which}", root.not_valid_after_utc, WARN_BEFORE,
            "every certificate it issued stops working then: roll over to a new CA "
            "(`llmgw ctl cert rotate-ca`, see docs/operations.md)",
        )
    check(
        f"the control plane's certificate {files.cert_path}", files.cert.not_valid_after_utc,
        WARN_BEFORE, "issue a new one with `llmgw ctl cert server` and send SIGHUP",
    )
    if files.crl is not None and files.crl.next_update_utc is not None:
        check(
            f"the CRL {files.crl_path}", files.crl.next_update_utc, crl_warn_before(files.crl),
            "after that every agent handshake is refused: run `llmgw ctl cert crl --renew` "
            "and send SIGHUP",
        )
    soon: list[tuple[float, str]] = []
    gone: list[tuple[float, str]] = []
    cutoff = _ts(now + WARN_BEFORE)
    for node_id, not_after in agents:
        if not_after <= 0:
            continue
        if not_after <= _ts(now):
            gone.append((not_after, node_id))
        elif not_after < cutoff:
            soon.append((not_after, node_id))
    for level, group, verb in (("error", gone, "have expired"), ("warn", soon, "expire within 30 days")):
        if not group:
            continue
        group.sort()
        named = ", ".join(
            f"{n} ({datetime.datetime.fromtimestamp(t, datetime.UTC).date()})"
            for t, n in group[:MAX_NODES_NAMED]
        )
        more = f" and {len(group) - MAX_NODES_NAMED} more" if len(group) > MAX_NODES_NAMED else ""
        out.append((
            level,
            f"the certificates of {len(group)} agents {verb}: {named}{more}; agents renew over their "
            "stream when the control plane signs (--signer) or an operator approves (`llmgw ctl csr "
            "approve NODE_ID`); else renew with `llmgw ctl cert agent NODE_ID` and SIGHUP the agent",
        ))
    return out


class TrustService(Service):
    """
    Reloads the control plane's TLS files on demand and on SIGHUP, closes
    the streams a new CRL revokes, and checks expiry dates periodically.

    @ivar reloads: successful and refused reloads, by outcome C{"ok"} and
        C{"refused"}.
    """

    log = Logger()
    name = "tls-trust"

    def __init__(
        self,
        reactor: IReactorTime,
        tls: ServerTLS,
        agents: AgentService,
        inventory: Inventory,
        handle_sighup: bool | None = None,
        check_interval: float = EXPIRY_CHECK_INTERVAL,
    ):
        self.reactor = reactor
        self.tls = tls
        self.agents = agents
        self.inventory = inventory
        if handle_sighup is None:
            handle_sighup = owns_signals(reactor)
        self.handle_sighup = handle_sighup
        self.check_interval = check_interval
        self.reloads = {"ok": 0, "refused": 0}
        self.last_reload_error: str | None = None
        self._sighup = SighupHandler(
            reactor, self.reload_tls,
            "the TLS certificate, key, CA bundle and CRL of the agent port and admin API"
        )
        self._loop: LoopingCall | None = None
        #: Records an event (kind, level, fields); set where the fleet's event log is.
        self.notify: Callable[..., None] | None = None
        self.notices = ExpiryNotices()

    # -- lifetime -----------------------------------------------------------

    def startService(self) -> None:
        super().startService()
        if self.handle_sighup:
            self._sighup.install()
        self._loop = LoopingCall(self._periodic_check)
        self._loop.clock = self.reactor
        self._loop.start(self.check_interval, now=True)

    def stopService(self) -> None:
        super().stopService()
        if self._loop is not None and self._loop.running:
            self._loop.stop()
        self._loop = None
        self._sighup.uninstall()

    # -- reload -------------------------------------------------------------

    def reload_tls(self) -> dict[str, Any]:
        """
        Read the certificate, key, CA and CRL again and use them for every
        new handshake. Open streams carry on, except those whose certificate
        the new CRL revokes, which are closed.

        Never raises for bad files: refused files are logged and reported in
        the result, and the running ones stay.

        @return: C{{"ok": bool, "error": str | None, "closed": [node ids],
            "server_serial": hex, "crl_number": int | None}}
        """
        try:
            files = self.tls.files.reread()
            self.tls.reload(files)
        except (TLSConfigError, SSL.Error, ValueError, TypeError) as e:
            self.reloads["refused"] += 1
            self.last_reload_error = str(e)
            self.log.error(
                "TLS reload refused, the running certificate, key, CA and CRL stay: {error}",
                error=str(e),
            )
            return {
                "ok": False, "error": str(e), "closed": [],
                "server_serial": format(self.tls.files.cert.serial_number, "x"),
                "crl_number": crl_number(self.tls.files.crl) if self.tls.files.crl else None,
            }
        self.reloads["ok"] += 1
        self.last_reload_error = None
        number = crl_number(files.crl) if files.crl is not None else None
        closed: list[str] = []
        if files.crl is not None:
            closed = self.agents.close_revoked(
                revoked_serials(files.crl), f"its certificate is revoked by CRL number {number}"
            )
        self.log.info(
            "TLS reloaded: server certificate serial {serial} (until {not_after}), "
            "CRL {crl}; {closed} revoked streams closed",
            serial=format(files.cert.serial_number, "x"),
            not_after=files.cert.not_valid_after_utc.isoformat(),
            crl=f"number {number}" if files.crl is not None else "none",
            closed=len(closed),
        )
        self.check_expiry()
        return {
            "ok": True, "error": None, "closed": closed,
            "server_serial": format(files.cert.serial_number, "x"), "crl_number": number,
        }

    # -- expiry -------------------------------------------------------------

    def _agent_expiries(self) -> Iterable[tuple[str, float]]:
        for node_id in self.inventory.ids():  # type: ignore[attr-defined]
            node = self.inventory.peek(node_id)
            if node is not None:
                yield node_id, node.certificate_not_after

    def expiry_snapshot(self) -> dict[str, Any]:
        """
        Expiry dates for metrics and the admin API. Times are Unix seconds
        (UTC); C{None} where there is nothing to report.

          - C{ca_not_after}, C{server_not_after}: the CA and the control
            plane's certificate in use now; C{server_serial} (hex)
          - C{crl_last_update}, C{crl_next_update}, C{crl_number},
            C{crl_revoked} (how many serials it lists): the CRL in force,
            C{None}/0 without one
          - C{agents_not_after}: node id to its certificate's end, as each
            agent reported at Register; C{agents_unreported}: nodes whose
            agent reported none; C{earliest_agent_not_after}
          - C{reloads_ok}, C{reloads_refused}, C{last_reload_error}
        """
        snap = expiry_snapshot(self.tls.files, self._agent_expiries())
        snap["reloads_ok"] = self.reloads["ok"]
        snap["reloads_refused"] = self.reloads["refused"]
        snap["last_reload_error"] = self.last_reload_error
        return snap

    def _periodic_check(self) -> None:
        # An exception would stop the LoopingCall for good.
        try:
            self.check_expiry()
            self.notice_expiring()
        except Exception:
            self.log.failure("checking TLS expiry failed")

    def notice_expiring(self) -> list[tuple[str, float]]:
        """
        An event (C{certificate_expiring}) for each connected node whose
        certificate ends within 7 days, once a day per node
        (L{ExpiryNotices}); returns those told of.
        """
        now = self.reactor.seconds()
        connected = set(self.agents.connected_nodes())
        due = self.notices.due(((n, t) for n, t in self._agent_expiries() if n in connected), now)
        for node_id, not_after in due:
            if self.notify is not None:
                left = max(0.0, not_after - now)
                self.notify("certificate_expiring", level="warn", node=node_id,
                            reason=f"its certificate ends in {left / 86400:.1f} days "
                            f"({datetime.datetime.fromtimestamp(not_after, datetime.UTC).isoformat()}); "
                            "it renews itself over its stream, or `llmgw ctl csr approve` it")
        return due

    def check_expiry(self) -> list[tuple[str, str]]:
        """
        Log what has expired (error) or expires soon (warning); returns the
        same as L{expiry_problems}.
        """
        now = datetime.datetime.fromtimestamp(self.reactor.seconds(), datetime.UTC)
        problems = expiry_problems(self.tls.files, self._agent_expiries(), now)
        for level, message in problems:
            if level == "error":
                self.log.error("TLS expiry: {message}", message=message)
            else:
                self.log.warn("TLS expiry: {message}", message=message)
        return problems
