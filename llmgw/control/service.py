"""
``twistd llmgw control``: the control plane as one C{MultiService}.

L{ControlPlane} can be embedded in another Twisted application without
twistd: build it, then C{setServiceParent} it.
"""

from __future__ import annotations

import time
import tomllib
from pathlib import Path
from typing import Any

from twisted.application.service import MultiService
from twisted.internet.base import ReactorBase
from twisted.logger import Logger
from twisted.protocols.tls import TLSMemoryBIOFactory
from twisted.python import usage

from llmgw.addresses import (
    AddressError,
    ListenerService,
    format_address,
    is_loopback,
    parse_address,
    server_endpoint,
)
from llmgw.collector import DEFAULT_GC_THRESHOLD, CollectorTuning
from llmgw.control.admin.site import (
    DEFAULT_ADMIN_HOST,
    DEFAULT_ADMIN_PORT,
    admin_service,
    admin_tls_problem,
)
from llmgw.control.core.catalog import EMPTY, CatalogError, load_catalog
from llmgw.control.shell import joinlisten
from llmgw.control.shell.agentsvc import AgentService
from llmgw.control.shell.limits import ConnectionLimiter, LimitsConfig, backlog_problem
from llmgw.control.shell.metrics import make_registry, register_control_metrics
from llmgw.control.shell.reconciler import Reconciler
from llmgw.control.shell.trust import TrustService
from llmgw.control.state.demand import InFlightDemand
from llmgw.control.state.interfaces import AdminError, IFleetAdmin, IStatusSink
from llmgw.control.state.inventory import Inventory
from llmgw.gateway.front import MAX_CONNECTIONS, REQUEST_TIMEOUT
from llmgw.gateway.proxy import GatewayConfig
from llmgw.gateway.service import DEFAULT_GATEWAY, GatewayService
from llmgw.memceiling import MemoryCeiling
from llmgw.memtrim import growth_trimmer
from llmgw.options import (
    HOSTS_DOC,
    api_keys,
    api_keys_row,
    backlog_row,
    certs_row,
    gateway_hosts_row,
    heartbeat_row,
    host_list,
    limit_share_row,
    listen_address,
    log_warnings,
    max_connections_row,
    memory_limit,
    memory_limit_row,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
    queue_bytes_rows,
)
from llmgw.options import Options as BaseOptions
from llmgw.oslimits import FdNeed, fd_limit_problem
from llmgw.routing import IDemand
from llmgw.signals import SighupService
from llmgw.tlsconf.options import ServerTLS, TLSConfigError, server_files
from llmgw.wire import DEFAULT_MAX_FRAME

DEFAULT_AGENT_PORT = 7443
#: The agent port's listen backlog: where a registration storm waits while
#: the admission gate is shut (see L{llmgw.control.shell.limits}). The kernel caps
#: it at net.core.somaxconn (4096 on current Linux).
DEFAULT_BACKLOG = 4096


#: The embedded gateway's defaults, for the options' help.
_GATEWAY = GatewayConfig()


class Options(BaseOptions):
    aliases = {"agents": "agent-listen", "heartbeat-interval": "heartbeat"}
    optParameters = [
        certs_row("certs", "directory with ca.pem, server.pem and server.key"),
        ["agent-listen", None, str(DEFAULT_AGENT_PORT),
         "[HOST:]PORT the agent stream listens on (IPv6 as [addr]:port)"],
        ["max-frame", None, DEFAULT_MAX_FRAME, "largest agent frame accepted, in bytes", positive_int],
        heartbeat_row(5.0, "agents' heartbeat interval in seconds; 3 silent intervals close a stream"),
        backlog_row(DEFAULT_BACKLOG, "listen backlog of the agent port (capped by net.core.somaxconn)"),
        ["admin", None, f"{DEFAULT_ADMIN_HOST}:{DEFAULT_ADMIN_PORT}",
         "[HOST:]PORT the admin API and /metrics listen on, or 'off'; beyond loopback it needs "
         "mutual TLS with admin certificates (--admin-tls, implied there)"],
        max_connections_row(LimitsConfig.max_connections, "most connections on the agent port (0: no cap)"),
        ["gateway-max-connections", None, MAX_CONNECTIONS,
         "most client connections of the embedded gateway at once; past it new ones are closed at "
         "accept (0: no cap)", non_negative_int],
        ["max-connections-per-address", None, LimitsConfig.max_per_address,
         "most agent-port connections from one source address (0: no cap)", non_negative_int],
        ["admin-max-connections-per-address", None, LimitsConfig.max_per_address,
         "most admin API connections from one source address when the admin API is over TLS or "
         "beyond loopback; past it new ones are closed at accept, before TLS (0: no cap)", non_negative_int],
        ["gateway-max-connections-per-address", None, 0,
         "most client connections of the embedded gateway from one address; past it new ones are "
         "closed at accept (0: no cap; for a gateway with no load balancer in front)", non_negative_int],
        ["gateway-request-timeout", None, REQUEST_TIMEOUT,
         "seconds a client of the embedded gateway may take to send a whole request, head and body, "
         "from its first byte, however its bytes trickle (then 408)", positive_float],
        *queue_bytes_rows("gateway-queue-bytes", _GATEWAY.queue_bytes_per_model, _GATEWAY.queue_bytes),
        memory_limit_row("gateway-memory-limit", "the control plane's process"),
        ["agent-message-rate", None, LimitsConfig.message_rate,
         "messages per second one agent may send before it is not read (0: no limit)", non_negative_float],
        ["agent-message-burst", None, LimitsConfig.message_burst,
         "messages one agent may send at once above its rate", non_negative_int],
        ["max-registering", None, LimitsConfig.max_registering,
         "connections between their first TLS byte and their Register at which the agent port stops "
         "accepting (the listen backlog holds the rest) until half are done (0: no limit)", non_negative_int],
        ["catalog", None, None, "catalog TOML (profiles and deployments), reloaded on SIGHUP; "
         "without one nothing is placed and every shard agents report is stopped"],
        ["pass-interval", None, 1.0, "seconds between reconcile passes", positive_float],
        ["suspect-after", None, 15.0, "seconds of silence before a node is suspect (nothing new placed)",
         positive_float],
        ["lost-after", None, 300.0, "seconds of silence before a node is lost (its replicas replaced)",
         positive_float],
        ["adoption-grace", None, 30.0, "seconds after start during which nothing is placed, "
         "while agents report what they run", non_negative_float],
        ["gateway", None, DEFAULT_GATEWAY,
         "[HOST:]PORT the OpenAI-compatible gateway listens on (0.0.0.0:8000 exposes it), or 'off'"],
        ["admin-hosts", None, "", HOSTS_DOC.format(what="the admin API")],
        gateway_hosts_row(),
        api_keys_row("gateway API keys file"),
        limit_share_row("the share of each API key's limits the embedded gateway enforces, in (0, 1]"),
        ["gc-threshold", None, DEFAULT_GC_THRESHOLD,
         "objects allocated between two young-generation runs of Python's cyclic collector "
         "(Python's default: 700); 0 leaves the collector as Python set it", non_negative_int],
        # One member of a highly available control plane on etcd.
        ["etcd", None, None, "comma-separated etcd client URLs (http:// or https://): run as one "
         "member of a highly available control plane; without it, the standalone default"],
        ["etcd-ca", None, None, "CA bundle that etcd's server certificates chain to (https)"],
        ["etcd-cert", None, None, "this member's client certificate for etcd (https)"],
        ["etcd-key", None, None, "the key of --etcd-cert"],
        ["etcd-prefix", None, "/llmgw", "key prefix of this control plane's state in etcd"],
        ["etcd-ttl", None, 10, "leader lease TTL in seconds (renewed every third of it)", positive_int],
        ["member-id", None, None, "this member's id in etcd (default: HOSTNAME-AGENTPORT)"],
        ["advertise-agents", None, None, "HOST:PORT agents dial for this member, named in redirects "
         "(default: --agent-listen, which must then not be a wildcard address)"],
        ["advertise-admin", None, "", "URL of this member's admin API, published while it leads "
         "(default: the admin listener's own address, which a wildcard --admin is not)"],
        *joinlisten.JOIN_OPTIONS,
        ["config", None, None, "TOML file holding any of these options by name "
         "(pass-interval = 2, insecure = true, ...); the command line wins"],
    ]
    optFlags = [
        *joinlisten.JOIN_FLAGS,
        ["insecure", None, "plain TCP without TLS or identity: development only, loopback only"],
        ["admin-tls", None, "serve the admin API over HTTPS requiring an admin certificate "
         "(`llmgw ctl cert admin`); on whenever --admin is beyond loopback"],
    ]

    def parseOptions(self, options: Any = None) -> None:
        # Remember what the command line named, so that --config fills in
        # only the rest.
        self.given: set[str] = set()
        for arg in options or []:
            if arg.startswith("--"):
                name = arg[2:].split("=", 1)[0]
                self.given.add(self.canonical(name) or name)
        super().parseOptions(options)

    def _apply_config(self, path: str) -> None:
        try:
            data = tomllib.loads(Path(path).read_text())
        except OSError as e:
            raise usage.UsageError(f"--config {path}: cannot be read: {e.strerror or e}") from e
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise usage.UsageError(f"--config {path}: not valid TOML: {e}") from e
        given: set[str] = getattr(self, "given", set())
        for key, value in data.items():
            name = self.canonical(key)
            if name is None or name in ("config", "help", "version"):
                raise usage.UsageError(f"--config {path}: {key!r} is not an option of this command")
            if name in given:
                continue
            if isinstance(self._dispatch[name], usage.CoerceParameter):
                if isinstance(value, bool) or not isinstance(value, str | int | float):
                    raise usage.UsageError(f"--config {path}: {key!r} must be a string or a number")
                try:
                    self.set_option(name, str(value))
                except usage.UsageError as e:
                    raise usage.UsageError(f"--config {path}: {e}") from None
            else:
                if not isinstance(value, bool):
                    raise usage.UsageError(f"--config {path}: {key!r} is a flag: write true or false")
                self[name] = int(value)

    def _reconciler_options(self) -> None:
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
        agents = listen_address(self, "agent-listen", "0.0.0.0" if not self["insecure"] else "127.0.0.1")
        assert agents is not None
        host, port = agents
        self["agents_host"], self["agents_port"] = host, port
        self["admin_address"] = listen_address(self, "admin", DEFAULT_ADMIN_HOST, off=True)
        self["admin_tls"] = bool(self["admin-tls"])
        if self["admin_address"] is not None and not is_loopback(self["admin_address"][0]):
            self["admin_tls"] = True
        if self["admin_tls"] and self["insecure"] and self["admin_address"] is not None:
            raise usage.UsageError(
                admin_tls_problem(self["admin_address"][0], False)
                or "--admin-tls needs the control plane's certificates, and --insecure runs without them"
            )
        self["gateway_address"] = listen_address(self, "gateway", "127.0.0.1", off=True)
        host_list(self, "admin-hosts")
        host_list(self, "gateway-hosts")
        api_keys(self)
        memory_limit(self, "gateway-memory-limit")
        if self["insecure"] and not is_loopback(host):
            raise usage.UsageError(
                f"--insecure serves the agent stream without TLS and is refused on {host}: "
                "use a loopback address such as 127.0.0.1"
            )
        self["limits"] = _limits(self)
        _etcd_options(self)
        if not self["insecure"]:
            try:
                self["tls"] = server_files(Path(self["certs"]))
            except TLSConfigError as e:
                raise usage.UsageError(
                    f"{e}. Make certificates with `llmgw ctl cert init` and "
                    "`llmgw ctl cert server --host ...`, or pass --certs DIR"
                ) from e
        joinlisten.join_post_options(self)


def _etcd_options(options: usage.Options) -> None:
    """
    Check the --etcd options (one member of a highly available control
    plane); C{etcd_urls} is [] without --etcd.
    """
    options["etcd_urls"] = []
    if not options["etcd"]:
        for name in ("etcd-ca", "etcd-cert", "etcd-key"):
            if options[name]:
                raise usage.UsageError(f"--{name} is only meaningful with --etcd")
        return
    urls = [u.strip().rstrip("/") for u in options["etcd"].split(",") if u.strip()]
    for url in urls:
        scheme, _, rest = url.partition("://")
        if scheme not in ("http", "https") or not rest or "/" in rest:
            raise usage.UsageError(f"--etcd: {url!r} is not an etcd client URL (http://HOST:PORT or https://...)")
    if not urls:
        raise usage.UsageError("--etcd: give at least one etcd client URL")
    options["etcd_urls"] = urls
    tls_files = [options["etcd-ca"], options["etcd-cert"], options["etcd-key"]]
    if any(tls_files) and not all(tls_files):
        raise usage.UsageError("--etcd-ca, --etcd-cert and --etcd-key go together")
    if any(u.startswith("https://") for u in urls) and not all(tls_files):
        raise usage.UsageError("https etcd members need --etcd-ca, --etcd-cert and --etcd-key")
    options["etcd_tls"] = None
    if all(tls_files):
        from llmgw.tlsconf.options import TLSFiles

        try:
            options["etcd_tls"] = TLSFiles.load(*tls_files)
        except TLSConfigError as e:
            raise usage.UsageError(f"--etcd-cert: {e}") from e
    prefix = options["etcd-prefix"].strip()
    if not prefix.startswith("/") or prefix == "/":
        raise usage.UsageError(f"--etcd-prefix {prefix!r}: give a key prefix such as /llmgw")
    options["etcd-prefix"] = prefix.rstrip("/")
    if options["etcd-ttl"] < 2:
        raise usage.UsageError("--etcd-ttl must be at least 2 seconds")
    host, port = options["agents_host"], options["agents_port"]
    advertised = options["advertise-agents"]
    if not advertised:
        if host in ("0.0.0.0", "::", ""):
            raise usage.UsageError(
                "--agent-listen is every address: give --advertise-agents HOST:PORT, the "
                "address agents dial for this member (redirects name it)"
            )
        advertised = format_address(host, port)
    else:
        try:
            a_host, a_port = parse_address(advertised, "")
        except AddressError as e:
            raise usage.UsageError(f"--advertise-agents: {e}") from e
        if not a_host or not a_port:
            raise usage.UsageError(f"--advertise-agents {advertised!r}: give HOST:PORT")
        advertised = format_address(a_host, a_port)
    options["advertise_agents"] = advertised
    if not options["member-id"]:
        import socket

        options["member-id"] = f"{socket.gethostname()}-{port}"


def _limits(options: usage.Options) -> LimitsConfig:
    return LimitsConfig(
        max_connections=options["max-connections"],
        max_per_address=options["max-connections-per-address"],
        message_rate=options["agent-message-rate"],
        message_burst=max(1, options["agent-message-burst"]),
        max_registering=options["max-registering"],
    )


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
    routing table), else C{None}; C{gateway} is the embedded gateway, if any.
    """

    log = Logger()
    reconciler: Reconciler | None = None
    gateway: GatewayService | None = None
    #: HA: this member's L{llmgw.control.ha.member.HAMember} with --etcd.
    ha: Any = None
    #: Joins and renewals (L{llmgw.control.shell.joinlisten.attach_joining}).
    joining: Any = None

    def __init__(
        self,
        reactor: Any,
        sink: IStatusSink,
        tls: ServerTLS | None,
        agents_host: str,
        agents_port: int,
        max_frame: int = DEFAULT_MAX_FRAME,
        heartbeat_interval: float = 5.0,
        backlog: int = DEFAULT_BACKLOG,
        inventory: Inventory | None = None,
        fleet: IFleetAdmin | None = None,
        admin_address: tuple[str, int] | None = None,
        limits: LimitsConfig | None = None,
        handle_sighup: bool | None = None,
        admin_tls: bool = False,
        admin_hosts: list[str] | None = None,
        admin_max_per_address: int = LimitsConfig.max_per_address,
    ):
        super().__init__()
        #: Admin API connections one source address may hold beyond
        #: loopback (0: no cap).
        self.admin_max_per_address = admin_max_per_address
        self.reactor = reactor
        #: Serve the admin API over mutual TLS with the agent port's
        #: certificates (always beyond loopback).
        self.admin_tls = admin_tls
        self.inventory = inventory if inventory is not None else Inventory()
        self.sink = sink
        self.tls = tls
        self.epoch = new_epoch()
        self.limits = limits if limits is not None else LimitsConfig()
        self.agents = AgentService(
            self.inventory,
            sink,
            clock=reactor,
            epoch=self.epoch,
            tls=tls is not None,
            require_identity=tls is not None,
            max_frame=max_frame,
            heartbeat_interval=heartbeat_interval,
            message_rate=self.limits.message_rate,
            message_burst=self.limits.message_burst,
        )
        factory: Any = self.agents
        if tls is not None:
            factory = TLSMemoryBIOFactory(tls, False, self.agents, clock=reactor)
        # Below TLS: a socket over a cap is closed before any handshake.
        self.limiter = ConnectionLimiter(
            factory, reactor, self.limits.max_connections, self.limits.max_per_address,
            self.limits.max_registering,
        )
        self.trust: TrustService | None = None
        if tls is not None:
            self.trust = TrustService(reactor, tls, self.agents, self.inventory, handle_sighup)
            self.trust.setServiceParent(self)
        self.backlog = backlog
        endpoint = server_endpoint(reactor, agents_host, agents_port, backlog=backlog)
        self.agent_listener = ListenerService(endpoint, self.limiter, "the agent stream", "--agent-listen")
        self.agent_listener.setName("agent-listener")
        self.agent_listener.setServiceParent(self)
        self.agents_address = (agents_host, agents_port)
        # Admin API and metrics: the registry is this control plane's own;
        # other parts (the gateway) add their metrics to it.
        self.fleet = fleet
        self.admin_address = admin_address
        self.admin_hosts = admin_hosts or []
        self.admin_listener: ListenerService | None = None
        self.registry = make_registry()
        self.metrics = register_control_metrics(
            self.registry, self.agents, lambda: self.fleet, self.tls_expiry_snapshot,
            limiter=lambda: getattr(self, "limiter", None), joining=lambda: getattr(self, "joining", None),
        )
        # engines: engine signals per shard, with their age
        from llmgw.control.state.signals import EngineSignalsCollector

        self.registry.register(EngineSignalsCollector(
            lambda: getattr(self.fleet, "engine_signal_rows", list)(), self.reactor.seconds,
        ))
        self._attach_admin()

    def _attach_admin(self) -> None:
        """
        Add the admin API's listener once there is a fleet to administer
        and an address to serve it on.
        """
        if self.admin_listener is not None or self.fleet is None or self.admin_address is None:
            return
        host, port = self.admin_address
        tls = self.tls if self.admin_tls or not is_loopback(host) else None
        self.admin_listener = admin_service(
            self.reactor, host, port, self.fleet, self.registry, self.agents, control=self,
            tls=tls,
            hosts=self.admin_hosts,
            max_per_address=self.admin_max_per_address,
            logins=True,
        )
        self.admin_listener.what, self.admin_listener.option = "the admin API", "--admin"
        self.admin_listener.setServiceParent(self)

    def startService(self) -> None:
        self.log.info(
            "control plane starting (epoch {epoch}); agent stream on {host}:{port} {mode}",
            epoch=self.epoch,
            host=self.agents_address[0],
            port=self.agents_address[1],
            mode="with mutual TLS" if self.tls else "WITHOUT TLS (development mode)",
        )
        self._attach_admin()
        if self.admin_address is not None and self.admin_listener is None:
            self.log.warn("no reconciler is running: the admin API and /metrics are not served")
        for problem in (backlog_problem(self.backlog), fd_limit_problem(self.fd_needs())):
            if problem:
                self.log.warn("{problem}", problem=problem)
        super().startService()
        # The admission gate stops and starts reading the listening port.
        self.limiter.attach_port(self.agent_listener.port)
        if self.admin_listener is not None and self.admin_listener.port is not None:
            host, port = self.admin_listener.address()
            tls = getattr(self.admin_listener, "tls", False)
            self.log.info(
                "admin API and /metrics on {scheme}://{address}{auth}",
                scheme="https" if tls else "http",
                address=format_address(host, port),
                auth=" (mutual TLS: admin certificates only)" if tls else "",
            )

    def fd_needs(self) -> list[FdNeed]:
        """
        The open files this control plane's listeners may hold at once, for
        the start-up check of the open-file limit: the agent port's, the
        embedded gateway's and the join listener's connections (the admin
        API's few are in the headroom).
        """
        needs = [FdNeed(self.limits.max_connections, "the agent port's connections", "--max-connections")]
        if self.gateway is not None:
            needs.append(self.gateway.fd_need("--gateway-max-connections"))
        return needs + getattr(self, "join_fd_needs", [])  # set by joinlisten.attach_joining

    def stopService(self) -> Any:
        # Stop listening first, then drop the streams still open: an embedded
        # control plane that stops must not keep speaking for the fleet.
        self.limiter.attach_port(None)
        d = super().stopService()
        self.agents.close_all("the control plane is stopping")
        return d

    def reload_tls(self) -> dict[str, Any]:
        """
        Re-read the agent port's certificate, key, CA and CRL (SIGHUP does
        this; so may the admin API). See L{TrustService.reload_tls}.
        """
        if self.trust is None:
            return {"ok": False, "error": "the agent port runs without TLS", "closed": []}
        return self.trust.reload_tls()

    def tls_expiry_snapshot(self) -> dict[str, Any]:
        """
        Expiry dates of the CA, server certificate, CRL and agents'
        certificates, for metrics; keys in L{TrustService.expiry_snapshot}.
        Empty without TLS.
        """
        return self.trust.expiry_snapshot() if self.trust is not None else {}


def makeService(options: Options, reactor: Any = None) -> ControlPlane:
    log_warnings(options, ControlPlane.log)
    own_process = reactor is None
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
        heartbeat_interval=options["heartbeat"],
        backlog=options["backlog"],
        admin_address=options["admin_address"],
        limits=options["limits"],
        fleet=reconciler,
        admin_tls=options.get("admin_tls", False),
        admin_hosts=options["admin-hosts"],
        admin_max_per_address=options["admin-max-connections-per-address"],
    )
    reconciler.setName("reconciler")
    cp.reconciler = reconciler
    joinlisten.attach_joining(cp, options, reactor)
    if options.get("etcd_urls"):
        # HA: leadership starts and stops the reconciler.
        _attach_ha(cp, reconciler, options, reactor)
    else:
        reconciler.attach(cp.agents, epoch=cp.epoch)
        reconciler.setServiceParent(cp)
    if not options["catalog"]:
        cp.log.warn(
            "no --catalog: nothing will be placed, and every shard agents report will be stopped"
        )
    # Each deployment's routing policy travels with the declared models in
    # the routing table (read from the catalog as it stands at each
    # publication, so reloads carry new policies too).
    follow_catalog_policies(reconciler)
    if cp.ha is None:
        # HA: with --etcd the catalog is etcd's (ctl catalog apply).
        reload = ReloadOnHangup(reactor, reconciler)
        reload.setServiceParent(cp)
    if own_process and options["gc-threshold"]:
        collector = CollectorTuning(options["gc-threshold"])
        collector.setName("collector")
        collector.setServiceParent(cp)
        # The fleet's records, once made, leave the collector's scans.
        reconciler.after_growth = collector.freeze_grown
    if options["gateway_address"] is not None:
        host, port = options["gateway_address"]
        # The embedded gateway routes by the published routing table, the
        # same one standalone gateways follow through GET /api/v1/routes.
        cp.gateway = GatewayService(
            reactor, reconciler.routing_table, host, port, keys=options["keyring"], registry=cp.registry,
            hosts=options["gateway-hosts"], config=GatewayConfig(
                limit_share=options["limit-share"], request_timeout=options["gateway-request-timeout"],
                max_per_address=options["gateway-max-connections-per-address"],
                queue_bytes_per_model=options["gateway-queue-bytes-per-model"],
                queue_bytes=options["gateway-queue-bytes"],
            ),
            max_connections=options["gateway-max-connections"],
            ceiling=MemoryCeiling(
                reactor, options["gateway-memory-limit"], what="the control plane",
                option="--gateway-memory-limit",
            ) if options["gateway-memory-limit"] else None,
        )
        cp.gateway.listener.option = "--gateway"
        cp.gateway.setName("gateway")
        cp.gateway.setServiceParent(cp)
        # The gateway's in-flight counts let a draining replica stop as soon
        # as it is idle.
        reconciler.set_in_flight(cp.gateway)
        # Autoscaling: a router that knows its demand (queue
        # included) is read for it; else the in-flight counts above are.
        # The embedded gateway counts in flight and waiting per model.
        gateway = cp.gateway.gateway
        router = gateway.router
        reconciler.set_demand_source(
            gateway if IDemand.providedBy(gateway) else InFlightDemand(router.snapshot, reconciler.model_of))
    if own_process:
        # Memory freed after a burst (a handshake flood, a watch storm) goes
        # back to the system; embedders' processes are left alone.
        trimmer = growth_trimmer(reactor)
        if trimmer is not None:
            trimmer.setName("memtrim")
            trimmer.setServiceParent(cp)
    return cp


def _attach_ha(cp: ControlPlane, reconciler: Reconciler, options: Options, reactor: Any) -> None:
    """
    HA: make C{cp} one member of a control plane on etcd
    (L{llmgw.control.ha.member}).
    """
    from llmgw.control.ha.election import MemberInfo
    from llmgw.control.ha.member import HACollector, HAMember
    from llmgw.etcd import EtcdClient
    from llmgw.tlsconf.options import ClientTLSPolicy

    tls = ClientTLSPolicy(options["etcd_tls"]) if options.get("etcd_tls") is not None else None
    client = EtcdClient(reactor, options["etcd_urls"], tls=tls)
    member = MemberInfo(options["member-id"], options["advertise_agents"], options["advertise-admin"])
    cp.ha = HAMember(
        reactor, cp, reconciler, client, options["etcd-prefix"], member, ttl=options["etcd-ttl"],
        catalog_file=options["catalog"] or None,
        admin_url=lambda: admin_url_to_publish(cp, options["advertise-admin"]),
        # The lease deadline on a clock that NTP cannot step back.
        # (A real reactor; a test's clock is its own time.)
        monotonic=time.monotonic if isinstance(reactor, ReactorBase) else None,
    )
    cp.ha.setName("ha")
    cp.ha.setServiceParent(cp)
    cp.registry.register(HACollector(cp.ha))


def admin_url_to_publish(cp: ControlPlane, advertised: str) -> tuple[str, str]:
    """
    The admin URL an HA member publishes while it leads, and why there is
    none when there is none: C{advertised} (C{--advertise-admin}) when the
    operator set it; else the admin listener's bound address, with the
    scheme it serves (C{https} under mutual TLS). A listener on every
    address (C{0.0.0.0}, C{::}) names no address another host could dial.
    """
    if advertised:
        return advertised, ""
    listener = cp.admin_listener
    if listener is None or listener.port is None:
        return "", "its admin API is off (--admin off), and it has no --advertise-admin"
    host, port = listener.address()
    if host in ("0.0.0.0", "::", ""):
        return "", (f"its admin API listens on every address ({format_address(host, port)}), which is no "
                    "address to send a client to: set --advertise-admin URL on each member")
    scheme = "https" if getattr(listener, "tls", False) else "http"
    return f"{scheme}://{format_address(host, port)}", ""


def follow_catalog_policies(reconciler: Any) -> None:
    """
    Have C{reconciler}'s routing table publish the catalog's routing policies, admission
    queue limits, stream resumption and adapters with the declared models, and now.
    """
    table = reconciler.routing_table
    table.policy_source = lambda: reconciler.catalog.routing_policies()
    table.set_policies(reconciler.catalog.routing_policies())
    # The admission queue's limits (queue_depth, queue_timeout_s) likewise.
    table.queue_source = lambda: reconciler.catalog.queue_limits()
    table.set_queue_limits(reconciler.catalog.queue_limits())
    # Streams continued elsewhere, off per deployment (resume_streams).
    table.resume_off_source = lambda: reconciler.catalog.resume_off()
    table.adapter_source = lambda: reconciler.catalog.adapter_bases()
    table.set_known(reconciler.catalog.deployments)


class ReloadOnHangup(SighupService):
    """
    Reloads the catalog on SIGHUP while running (see L{SighupService}).
    """

    log = Logger()

    def __init__(self, reactor: Any, reconciler: Reconciler, handle_sighup: bool | None = None):
        self.reconciler = reconciler
        super().__init__(reactor, "the catalog", handle_sighup)

    def reload(self) -> None:
        try:
            summary = self.reconciler.reload_catalog()
        except AdminError as e:
            self.log.error("catalog reload on SIGHUP refused: {error}", error=str(e))
            return
        self.log.info("catalog reloaded on SIGHUP: {summary}", summary=summary)
