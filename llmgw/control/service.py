"""
``twistd llmgw control``: the control plane as one C{MultiService}.

L{ControlPlane} can be embedded in another Twisted application without
twistd: build it, then C{setServiceParent} it.
"""

from __future__ import annotations

import signal
import time
import tomllib
from pathlib import Path
from typing import Any

from twisted.application.service import MultiService, Service
from twisted.logger import Logger
from twisted.protocols.tls import TLSMemoryBIOFactory
from twisted.python import usage

from llmgw.addresses import (
    AddressError,
    ListenerService,
    is_loopback,
    parse_address,
    server_endpoint,
)
from llmgw.control.agentsvc import AgentService
from llmgw.control.catalog import EMPTY, CatalogError, load_catalog
from llmgw.control.interfaces import AdminError, IStatusSink
from llmgw.control.inventory import Inventory
from llmgw.control.reconciler import Reconciler
from llmgw.tlsconf.options import ServerTLS, TLSConfigError, server_files
from llmgw.wire import DEFAULT_MAX_FRAME

DEFAULT_AGENT_PORT = 7443


class Options(usage.Options):
    optParameters = [
        ["certs", None, "certs", "directory with ca.pem, server.pem and server.key"],
        ["agents", None, str(DEFAULT_AGENT_PORT), "[HOST:]PORT for the agent stream (IPv6 as [addr]:port)"],
        ["max-frame", None, str(DEFAULT_MAX_FRAME), "largest agent frame accepted, in bytes"],
        ["heartbeat-interval", None, "5", "agents' heartbeat interval in seconds; 3 silent intervals close a stream"],
        ["backlog", None, "1024", "listen backlog of the agent port"],
        ["catalog", None, None, "catalog TOML (profiles and deployments), reloaded on SIGHUP; "
         "without one nothing is placed and every shard agents report is stopped"],
        ["pass-interval", None, "1", "seconds between reconcile passes"],
        ["suspect-after", None, "15", "seconds of silence before a node is suspect (nothing new placed)"],
        ["lost-after", None, "300", "seconds of silence before a node is lost (its replicas replaced)"],
        ["adoption-grace", None, "30", "seconds after start during which nothing is placed, "
         "while agents report what they run"],
        ["config", None, None, "TOML file holding any of these options by name "
         "(pass-interval = 2, insecure = true, ...); the command line wins"],
    ]
    optFlags = [
        ["insecure", None, "plain TCP without TLS or identity: development only, loopback only"],
    ]

    def parseOptions(self, options: Any = None) -> None:
        # Remember what the command line named, so that --config fills in
        # only the rest.
        self.given: set[str] = set()
        for arg in options or []:
            if arg.startswith("--"):
                name = arg[2:].split("=", 1)[0]
                self.given.add(self.synonyms.get(name) or self.synonyms.get(name.replace("-", "_"), name))
        super().parseOptions(options)

    def _apply_config(self, path: str) -> None:
        try:
            data = tomllib.loads(Path(path).read_text())
        except OSError as e:
            raise usage.UsageError(f"--config {path}: cannot be read: {e.strerror or e}") from e
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise usage.UsageError(f"--config {path}: not valid TOML: {e}") from e
        given = getattr(self, "given", set())
        for key, value in data.items():
            name = self.synonyms.get(key) or self.synonyms.get(key.replace("_", "-"))
            if name is None or name == "config":
                raise usage.UsageError(f"--config {path}: {key!r} is not an option of this command")
            if name in given:
                continue
            if isinstance(self._dispatch[name], usage.CoerceParameter):
                if isinstance(value, bool) or not isinstance(value, str | int | float):
                    raise usage.UsageError(f"--config {path}: {key!r} must be a string or a number")
                self[name] = str(value)
            else:
                if not isinstance(value, bool):
                    raise usage.UsageError(f"--config {path}: {key!r} is a flag: write true or false")
                self[name] = int(value)

    def _reconciler_options(self) -> None:
        for name in ("pass-interval", "suspect-after", "lost-after", "adoption-grace"):
            try:
                self[name] = float(self[name])
            except (TypeError, ValueError):
                raise usage.UsageError(f"--{name} must be a number of seconds, not {self[name]!r}") from None
            if self[name] < 0 or (self[name] == 0 and name != "adoption-grace"):
                raise usage.UsageError(f"--{name} must be positive")
        if self["lost-after"] <= self["suspect-after"]:
            raise usage.UsageError("--lost-after must be longer than --suspect-after")
        if self["catalog"]:
            try:
                self["catalog_loaded"] = load_catalog(self["catalog"])
            except CatalogError as e:
                raise usage.UsageError(str(e)) from e
        else:
            self["catalog_loaded"] = EMPTY

    def postOptions(self) -> None:
        if self["config"]:
            self._apply_config(self["config"])
        self._reconciler_options()
        try:
            host, port = parse_address(self["agents"], "0.0.0.0" if not self["insecure"] else "127.0.0.1")
        except AddressError as e:
            raise usage.UsageError(f"--agents: {e}") from e
        self["agents_host"], self["agents_port"] = host, port
        if self["insecure"] and not is_loopback(host):
            raise usage.UsageError(
                f"--insecure serves the agent stream without TLS and is refused on {host}: "
                "use a loopback address such as 127.0.0.1"
            )
        for name in ("max-frame", "backlog"):
            try:
                self[name] = int(self[name])
            except ValueError:
                raise usage.UsageError(f"--{name} must be an integer") from None
            if self[name] <= 0:
                raise usage.UsageError(f"--{name} must be positive")
        try:
            self["heartbeat-interval"] = float(self["heartbeat-interval"])
        except ValueError:
            raise usage.UsageError("--heartbeat-interval must be a number of seconds") from None
        if self["heartbeat-interval"] <= 0:
            raise usage.UsageError("--heartbeat-interval must be positive")
        if not self["insecure"]:
            try:
                self["tls"] = server_files(Path(self["certs"]))
            except TLSConfigError as e:
                raise usage.UsageError(
                    f"{e}. Make certificates with `llmgw ctl cert init` and "
                    "`llmgw ctl cert server --host ...`, or pass --certs DIR"
                ) from e


def new_epoch() -> int:
    """
    This control plane's epoch: milliseconds since 1970 at start, so a
    later start has a larger epoch than any earlier one on a sane clock.
    """
    return int(time.time() * 1000)


class ControlPlane(MultiService):
    """
    The control plane's parts. C{inventory}, C{sink} and C{agents} (the
    agent service, which is the dispatcher) are attributes other parts use;
    C{reconciler} is the sink when it is a L{Reconciler} (the fleet admin and
    routing table), else C{None}.
    """

    log = Logger()
    reconciler: Reconciler | None = None

    def __init__(
        self,
        reactor: Any,
        sink: IStatusSink,
        tls: ServerTLS | None,
        agents_host: str,
        agents_port: int,
        max_frame: int = DEFAULT_MAX_FRAME,
        heartbeat_interval: float = 5.0,
        backlog: int = 1024,
        inventory: Inventory | None = None,
    ):
        super().__init__()
        self.reactor = reactor
        self.inventory = inventory if inventory is not None else Inventory()
        self.sink = sink
        self.tls = tls
        self.epoch = new_epoch()
        self.agents = AgentService(
            self.inventory,
            sink,
            clock=reactor,
            epoch=self.epoch,
            tls=tls is not None,
            require_identity=tls is not None,
            max_frame=max_frame,
            heartbeat_interval=heartbeat_interval,
        )
        factory: Any = self.agents
        if tls is not None:
            factory = TLSMemoryBIOFactory(tls, False, self.agents)
        endpoint = server_endpoint(reactor, agents_host, agents_port, backlog=backlog)
        self.agent_listener = ListenerService(endpoint, factory)
        self.agent_listener.setName("agent-listener")
        self.agent_listener.setServiceParent(self)
        self.agents_address = (agents_host, agents_port)

    def startService(self) -> None:
        self.log.info(
            "control plane starting (epoch {epoch}); agent stream on {host}:{port} {mode}",
            epoch=self.epoch,
            host=self.agents_address[0],
            port=self.agents_address[1],
            mode="with mutual TLS" if self.tls else "WITHOUT TLS (development mode)",
        )
        super().startService()


def makeService(options: Options, reactor: Any = None) -> ControlPlane:
    if reactor is None:
        from twisted.internet import reactor as _reactor

        reactor = _reactor
    tls = ServerTLS(options["tls"]) if not options["insecure"] else None
    inventory = Inventory()
    reconciler = Reconciler(
        options["catalog_loaded"],
        inventory,
        clock=reactor,
        pass_interval=options["pass-interval"],
        suspect_after=options["suspect-after"],
        lost_after=options["lost-after"],
        adoption_grace=options["adoption-grace"],
    )
    cp = ControlPlane(
        reactor,
        sink=reconciler,
        inventory=inventory,
        tls=tls,
        agents_host=options["agents_host"],
        agents_port=options["agents_port"],
        max_frame=options["max-frame"],
        heartbeat_interval=options["heartbeat-interval"],
        backlog=options["backlog"],
    )
    reconciler.attach(cp.agents, epoch=cp.epoch)
    reconciler.setName("reconciler")
    reconciler.setServiceParent(cp)
    cp.reconciler = reconciler
    if not options["catalog"]:
        cp.log.warn(
            "no --catalog: nothing will be placed, and every shard agents report will be stopped"
        )
    reload = ReloadOnHangup(reactor, reconciler)
    reload.setServiceParent(cp)
    return cp


class ReloadOnHangup(Service):
    """
    Reloads the catalog on SIGHUP. A handler installed before is still
    called, so other parts may reload on the same signal.
    """

    log = Logger()

    def __init__(self, reactor: Any, reconciler: Reconciler):
        self.reactor = reactor
        self.reconciler = reconciler
        self._previous: Any = None
        self._installed = False

    def startService(self) -> None:
        super().startService()
        try:
            self._previous = signal.signal(signal.SIGHUP, self._on_signal)
            self._installed = True
        except ValueError:
            # Not the main thread (embedded): no signals here.
            self.log.info("not reloading the catalog on SIGHUP: not in the main thread")

    def stopService(self) -> Any:
        super().stopService()
        if self._installed and signal.getsignal(signal.SIGHUP) == self._on_signal:
            signal.signal(signal.SIGHUP, self._previous or signal.SIG_DFL)
        self._installed = False
        return None

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.reactor.callFromThread(self.reload)
        if callable(self._previous):
            self._previous(signum, frame)

    def reload(self) -> None:
        try:
            summary = self.reconciler.reload_catalog()
        except AdminError as e:
            self.log.error("catalog reload on SIGHUP refused: {error}", error=str(e))
            return
        self.log.info("catalog reloaded on SIGHUP: {summary}", summary=summary)
