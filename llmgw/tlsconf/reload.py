"""
Reloading a TLS client's certificate, key and CA bundle on SIGHUP, for
processes other than the agent (which has its own): the standalone
gateway's certificate for the admin API.
"""

from __future__ import annotations

from typing import Any

from twisted.application.service import Service
from twisted.logger import Logger

from llmgw.signals import SighupHandler, owns_signals
from llmgw.tlsconf.options import ClientTLSPolicy, TLSConfigError


class ClientCertificateReload(Service):
    """
    Re-reads C{policy}'s files on SIGHUP (only when C{reactor} is the
    process's own) and through L{reload}: new connections use them, open
    ones carry on; refused files are logged and the running ones stay.
    """

    log = Logger()

    def __init__(
        self, reactor: Any, policy: ClientTLSPolicy, what: str,
        handle_sighup: bool | None = None,
    ):
        self.policy = policy
        self.what = what
        self.handle_sighup = owns_signals(reactor) if handle_sighup is None else handle_sighup
        self._sighup = SighupHandler(reactor, self.reload, what)

    def startService(self) -> None:
        super().startService()
        if self.handle_sighup:
            self._sighup.install()

    def stopService(self) -> Any:
        super().stopService()
        self._sighup.uninstall()
        return None

    def reload(self) -> bool:
        """
        @return: whether the new files were taken.
        """
        try:
            files = self.policy.reload()
        except TLSConfigError as e:
            self.log.error(
                "{what}: reload refused, the running certificate and CA stay: {error}",
                what=self.what, error=str(e),
            )
            return False
        self.log.info(
            "{what} reloaded from {path}: serial {serial}, {roots} trusted root(s); "
            "used from the next connection",
            what=self.what, path=str(files.cert_path),
            serial=format(files.cert.serial_number, "x"), roots=len(files.roots),
        )
        return True
