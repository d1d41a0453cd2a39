"""
Reloading a TLS client's certificate, key and CA bundle on SIGHUP, for
processes other than the agent (which has its own): the standalone
gateway's certificate for the admin API.
"""

from __future__ import annotations

from typing import Any

from twisted.logger import Logger

from llmgw.signals import SighupService
from llmgw.tlsconf.options import ClientTLSPolicy, TLSConfigError


class ClientCertificateReload(SighupService):
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
        super().__init__(reactor, what, handle_sighup)

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
