"""
``twistd llmgw gateway``: the gateway in its own process, following the
control plane's routing table; and L{GatewayService}, the same front for
the control plane to embed with its own routing table.
"""

from __future__ import annotations

import os
import socket
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.twisted import MetricsResource
from twisted.application.service import MultiService
from twisted.logger import Logger
from twisted.python import usage
from twisted.web.resource import Resource
from zope.interface import implementer

from llmgw.addresses import (
    ListenerService,
    format_address,
    is_loopback,
    server_endpoint,
)
from llmgw.collector import CollectorTuning
from llmgw.gateway.demand import DemandReporter
from llmgw.gateway.firstbyte import FirstByteWatch, watch_service
from llmgw.gateway.follower import FollowerTable
from llmgw.gateway.follower_service import FollowerService
from llmgw.gateway.forwarding import FORWARDED_HEADERS
from llmgw.gateway.front import MAX_CONNECTIONS
from llmgw.gateway.keys import KeyRing
from llmgw.gateway.proxy import Gateway, GatewayConfig
from llmgw.gateway.resource import GatewayResource, GatewaySite
from llmgw.gateway.usage import UsageResource
from llmgw.hostcheck import HostCheck, unlisted_names_warning
from llmgw.httpdeadline import DeadlineSite
from llmgw.memceiling import MemoryCeiling
from llmgw.memtrim import growth_trimmer
from llmgw.options import (
    Options as BaseOptions,
)
from llmgw.options import (
    api_keys,
    api_keys_row,
    backlog_row,
    certs_row,
    gateway_hosts_row,
    host_list,
    limit_share_row,
    listen_address,
    log_warnings,
    max_connections_row,
    memory_limit,
    memory_limit_row,
    non_negative_int,
    positive_float,
    positive_int,
    queue_bytes_rows,
)
from llmgw.oslimits import FdNeed, fd_limit_problem
from llmgw.routing import Demand, IDemand, IInFlight, IRoutingTable, RoutingSnapshot
from llmgw.tlsconf.options import ClientTLSPolicy, TLSConfigError, admin_files
from llmgw.tlsconf.reload import ClientCertificateReload

DEFAULT_GATEWAY = "127.0.0.1:8000"
DEFAULT_METRICS = "127.0.0.1:7481"
DEFAULT_CONTROL_ADMIN = "http://127.0.0.1:7480"


def hot_path_build() -> str:
    """
    How the gateway's per-request modules were built: C{"compiled"} (by
    mypyc, setup.py's C{LLMGW_COMPILE=1}) or C{"pure Python"}.
    """
    from importlib.machinery import EXTENSION_SUFFIXES

    from llmgw.gateway import front

    return "compiled" if (front.__file__ or "").endswith(tuple(EXTENSION_SUFFIXES)) else "pure Python"


@implementer(IInFlight, IDemand)
class GatewayService(MultiService):
    """
    The gateway's HTTP front on C{host}:C{port}, routing by C{table}.

    C{gateway} (the shared state, an L{IInFlight}) and C{listener} (whose
    C{address()} is the bound address once running) are attributes; the
    gateway's metrics go into C{registry} (a new one when not given). It
    answers to the loopback names, C{host} unless it is a wildcard, and
    C{hosts} (entries as L{llmgw.hostcheck.parse_hosts} returns them).
    With a memory C{ceiling} (L{llmgw.memceiling}), which becomes its child
    service, it refuses new requests while the ceiling sheds.
    """

    log = Logger()

    def __init__(
        self,
        reactor: Any,
        table: IRoutingTable,
        host: str = "127.0.0.1",
        port: int = 8000,
        config: GatewayConfig | None = None,
        keys: KeyRing | None = None,
        registry: CollectorRegistry | None = None,
        backlog: int = 1024,
        hosts: list[str] | None = None,
        max_connections: int = MAX_CONNECTIONS,
        ceiling: MemoryCeiling | None = None,
    ):
        super().__init__()
        self.reactor = reactor
        check = HostCheck(hosts or (), bound=host, option="--gateway-hosts")
        self.gateway = Gateway(reactor, table, config, registry, keys, check)
        self.registry = self.gateway.registry
        self.ceiling = ceiling
        if ceiling is not None:
            ceiling.setServiceParent(self)
            ceiling.register(self.registry)
        self.site = GatewaySite(GatewayResource(self.gateway, ceiling), reactor=reactor)
        # Past the cap a client connection is closed at accept; starting
        # the site raises the open-file limit to what the cap needs.
        self.site.max_connections = max_connections
        self.listener = ListenerService(
            server_endpoint(reactor, host, port, backlog), self.site, "the gateway", "--gateway"
        )
        self.listener.setName("gateway-listener")
        self.listener.setServiceParent(self)
        self.host, self.port = host, port
        # Replicas that stop sending first bytes while others answer are
        # benched here, before the control plane's verdict.
        unstarted = self.gateway.unstarted
        self.first_byte = FirstByteWatch(reactor, unstarted, self.gateway.router.bench, self.registry)
        unstarted.on_answer = self.first_byte.answered
        watch_service(self.first_byte, reactor).setServiceParent(self)
        subscribe = getattr(table, "subscribe", None)
        if subscribe is not None:
            # The control plane's own table (the embedded gateway): requests
            # waiting on a replica that left it go elsewhere at once, as a
            # standalone gateway's do (StandaloneGateway's forget_gone).
            def left(revision: int, models: frozenset[str], known_changed: bool) -> None:
                keep = table.snapshot().replica_ids()  # type: ignore[attr-defined]
                unstarted.left(keep)
                self.first_byte.forget(keep)

            subscribe(left)
        self.hosts = list(hosts or ())

    def fd_need(self, option: str | None) -> FdNeed:
        """
        The open files this gateway's front may hold at once: each client
        connection and an upstream connection for it. C{option} is the one
        that sets its cap in this process, if any.
        """
        cap = self.site.max_connections
        return FdNeed(2 * cap, f"the gateway's {cap} client connections and their upstream ones", option)

    def in_flight(self, replica_id: str) -> int:
        return self.gateway.in_flight(replica_id)

    def demand(self) -> dict[str, Demand]:
        """
        L{IDemand}: this gateway's requests in flight and waiting, per model
        (what the control plane's autoscaler reads of the embedded gateway).
        """
        return self.gateway.demand()

    def startService(self) -> None:
        super().startService()
        host, port = self.listener.address()
        self.log.info(
            "gateway listening on {address}{exposed}; API keys {keys}; hot path {build}",
            address=format_address(host, port),
            exposed="" if is_loopback(host) else " (reachable from other machines)",
            keys=f"required ({len(self.gateway.keys)} configured)" if self.gateway.keys else "not required",
            build=hot_path_build(),
        )
        warning = unlisted_names_warning("the gateway", self.host, self.hosts, "--gateway-hosts")
        if warning:
            self.log.warn("{problem}", problem=warning)

    def stopService(self) -> Any:
        d = super().stopService()
        self.gateway.close()
        return d


#: The defaults the options show (an instance's: a compiled dataclass keeps
#: no defaults on the class).
_DEFAULTS = GatewayConfig()


class Options(BaseOptions):
    aliases = {
        "listen": "gateway", "control-admin": "admin-url", "admin-certs": "certs", "admin-as": "as",
    }
    optParameters = [
        ["gateway", None, DEFAULT_GATEWAY,
         "[HOST:]PORT the gateway listens on; loopback by default, 0.0.0.0:8000 exposes it"],
        certs_row(None, "with an https:// --admin-url: the directory with ca.pem and this "
                  "gateway's admin-NAME.pem/.key (`llmgw ctl cert admin NAME --role gateway`)"),
        ["as", None, None, "with an https:// --admin-url: NAME of the certificate in --certs"],
        ["poll-interval", None, 2.0,
         "seconds before retrying a failed read of the control plane's routes (doubled on each "
         "failure in a row, up to 30); while it answers, the routes are long-polled",
         positive_float],
        ["metrics", None, DEFAULT_METRICS, "[HOST:]PORT for /metrics (Prometheus), or 'off'"],
        api_keys_row("API keys file"),
        limit_share_row("the share of each API key's limits this gateway enforces, in (0, 1]: 1/N "
                        "for N gateways behind one address"),
        ["max-body", None, _DEFAULTS.max_body, "largest request body accepted, in bytes",
         positive_int],
        ["connect-timeout", None, _DEFAULTS.connect_timeout, "seconds to connect to a replica",
         positive_float],
        ["forwarded-headers", None, _DEFAULTS.forwarded_headers,
         "what replicas are told of the client: x-forwarded (X-Forwarded-For and -Proto), full (also "
         "X-Forwarded-Host, X-Real-IP and Forwarded) or none; a client's own are always dropped"],
        ["first-byte-timeout", None, _DEFAULTS.first_byte_timeout,
         "seconds a replica may take before the first byte of its answer", positive_float],
        ["idle-timeout", None, _DEFAULTS.idle_timeout,
         "seconds a replica may stay silent in the middle of an answer", positive_float],
        ["head-timeout", None, _DEFAULTS.head_timeout,
         "seconds a client may take to send a request's head, from its first byte (then 408)",
         positive_float],
        ["request-timeout", None, _DEFAULTS.request_timeout,
         "seconds a client may take to send a whole request, head and body, from its first "
         "byte, however its bytes trickle (then 408)", positive_float],
        ["body-timeout", None, _DEFAULTS.body_timeout,
         "seconds a client's request body may go without a byte arriving (then 408)",
         positive_float],
        ["keep-alive-timeout", None, _DEFAULTS.keep_alive_timeout,
         "seconds a kept-alive client connection may wait for its next request", positive_float],
        ["max-tries", None, _DEFAULTS.max_tries, "replicas tried when connections fail",
         positive_int],
        ["gateway-id", None, None, "the name this gateway reports its demand under, for the "
         "autoscaler (default HOSTNAME-PID)"],
        ["failure-threshold", None, _DEFAULTS.failure_threshold,
         "failures in a row that take a replica out of rotation", positive_int],
        ["cooldown", None, _DEFAULTS.cooldown, "seconds a failing replica stays out of rotation",
         positive_float],
        backlog_row(1024, "listen backlog"),
        gateway_hosts_row(),
        ["queue-depth", None, _DEFAULTS.queue_depth,
         "requests that may wait per model when no replica can take them (0: none wait, 503 at "
         "once); a deployment's queue_depth wins", non_negative_int],
        ["queue-timeout", None, _DEFAULTS.queue_timeout_s,
         "seconds a request may wait for a replica before its 503; a deployment's "
         "queue_timeout_s wins", positive_float],
        *queue_bytes_rows("queue-bytes", _DEFAULTS.queue_bytes_per_model, _DEFAULTS.queue_bytes),
        memory_limit_row("memory-limit", "this gateway process"),
        max_connections_row(
            MAX_CONNECTIONS, "most client connections at once; past it new ones are closed at accept (0: no cap)"),
        ["max-connections-per-address", None, 0,
         "most client connections from one address; past it new ones are closed at accept (0: no "
         "cap; for a gateway with no load balancer in front)", non_negative_int],
    ]

    def opt_admin_url(self, url: str) -> None:
        """
        URL of the control plane's admin API to follow (default
        http://127.0.0.1:7480); repeat it for each member of an HA control
        plane: the gateway reads from one and tries the next when it fails.
        """
        self.setdefault("admin-urls", []).append(url)

    def opt_keys(self, path: str) -> None:
        """
        Old name of --api-keys (warns; will go).
        """
        self["api-keys"] = path
        self.warn_renamed("keys", "api-keys")

    def postOptions(self) -> None:
        listen = listen_address(self, "gateway", "127.0.0.1")
        assert listen is not None
        self["listen_host"], self["listen_port"] = listen
        if self["forwarded-headers"] not in FORWARDED_HEADERS:
            raise usage.UsageError(
                f"--forwarded-headers: {self['forwarded-headers']!r} is not one of {', '.join(FORWARDED_HEADERS)}"
            )
        self["metrics_address"] = listen_address(self, "metrics", "127.0.0.1", off=True)
        urls = self.setdefault("admin-urls", [])
        if not urls:
            urls.append(DEFAULT_CONTROL_ADMIN)
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise usage.UsageError(f"--admin-url: {url!r} is not an http:// or https:// URL")
        if len(set(urls)) != len(urls):
            raise usage.UsageError(f"--admin-url: a URL is given twice ({', '.join(urls)})")
        #: The first, as before several could be given.
        self["admin-url"] = urls[0]
        https = [u for u in urls if u.startswith("https://")]
        url = https[0] if https else urls[0]
        host_list(self, "gateway-hosts")
        self["admin_tls"] = None
        if url.startswith("https://"):
            if not self["certs"] or not self["as"]:
                raise usage.UsageError(
                    f"--admin-url {url} is https: give this gateway's admin certificate "
                    "with --certs DIR and --as NAME"
                )
            try:
                self["admin_tls"] = ClientTLSPolicy(admin_files(self["certs"], self["as"]))
            except TLSConfigError as e:
                raise usage.UsageError(f"--certs/--as: {e}") from e
        api_keys(self)
        memory_limit(self, "memory-limit")

    def config(self) -> GatewayConfig:
        return GatewayConfig(
            max_body=self["max-body"],
            connect_timeout=self["connect-timeout"],
            first_byte_timeout=self["first-byte-timeout"],
            idle_timeout=self["idle-timeout"],
            head_timeout=self["head-timeout"],
            request_timeout=self["request-timeout"],
            body_timeout=self["body-timeout"],
            max_per_address=self["max-connections-per-address"],
            keep_alive_timeout=self["keep-alive-timeout"],
            max_tries=self["max-tries"],
            failure_threshold=self["failure-threshold"],
            cooldown=self["cooldown"],
            limit_share=self["limit-share"],
            queue_depth=self["queue-depth"],
            queue_timeout_s=self["queue-timeout"],
            queue_bytes_per_model=self["queue-bytes-per-model"],
            queue_bytes=self["queue-bytes"],
            forwarded_headers=self["forwarded-headers"],
        )


class StandaloneGateway(MultiService):
    """
    A gateway following a control plane: C{table} (the L{FollowerTable}),
    C{follower} (its poll loop), C{front} (the L{GatewayService}) and, when
    asked for, C{metrics_listener}.
    """

    log = Logger()

    def __init__(
        self,
        reactor: Any,
        admin_url: str | list[str],
        host: str,
        port: int,
        config: GatewayConfig | None = None,
        keys: KeyRing | None = None,
        poll_interval: float = 2.0,
        metrics_address: tuple[str, int] | None = None,
        backlog: int = 1024,
        http: Any = None,
        admin_tls: Any = None,
        hosts: list[str] | None = None,
        max_connections: int = MAX_CONNECTIONS,
        gateway_id: str | None = None,
        ceiling: MemoryCeiling | None = None,
    ):
        super().__init__()
        self.registry = CollectorRegistry()
        self.table = FollowerTable(
            reactor, admin_url, http=http, registry=self.registry, tls=admin_tls
        )
        # The watch stream when dialling for real; a test's stub HTTP client
        # has no socket to upgrade.
        self.follower = FollowerService(self.table, retry=poll_interval, watch=http is None)
        self.follower.setServiceParent(self)
        if admin_tls is not None:
            # SIGHUP re-reads the gateway's admin certificate and CA bundle.
            ClientCertificateReload(
                reactor, admin_tls, "the gateway's admin API certificate"
            ).setServiceParent(self)
        self.front = GatewayService(
            reactor, self.table, host, port, config, keys, self.registry, backlog, hosts, max_connections,
            ceiling,
        )
        self.front.setServiceParent(self)
        router = self.front.gateway.router
        unstarted = self.front.gateway.unstarted

        def forget_gone(snapshot: RoutingSnapshot) -> None:
            # Requests still waiting on a replica that left go elsewhere now.
            unstarted.left(snapshot.replica_ids())
            router.forget(snapshot.replica_ids())
            self.front.first_byte.forget(snapshot.replica_ids())

        self.table.listeners.append(forget_gone)
        # Autoscaling: a gateway whose router knows its demand
        # reports it to the control plane every second.
        self.demand_reporter: DemandReporter | None = None
        source = next((o for o in (router, self.front.gateway) if IDemand.providedBy(o)), None)
        if source is not None:
            self.demand_reporter = DemandReporter(
                self.table, source, gateway_id or f"{socket.gethostname()}-{os.getpid()}")
            self.demand_reporter.setServiceParent(self)
        self.metrics_listener: ListenerService | None = None
        if metrics_address is not None:
            root = Resource()
            root.putChild(b"metrics", MetricsResource(registry=self.registry))
            # usage per API key: this gateway's own, beside its /metrics
            api = Resource()
            root.putChild(b"api", api)
            v1 = Resource()
            api.putChild(b"v1", v1)
            v1.putChild(b"usage", UsageResource(
                self.front.gateway.usage,
                HostCheck(hosts or (), bound=metrics_address[0], option="--gateway-hosts")))
            # Each request must arrive in time, however its bytes trickle.
            site = DeadlineSite(root, reactor=reactor)
            site.log = lambda request: None  # type: ignore[method-assign]
            self.metrics_listener = ListenerService(
                server_endpoint(reactor, metrics_address[0], metrics_address[1]),
                site,
                "the gateway's /metrics",
                "--metrics",
            )
            self.metrics_listener.setServiceParent(self)

    def startService(self) -> None:
        problem = fd_limit_problem([self.front.fd_need("--max-connections")])
        if problem:
            self.log.warn("{problem}", problem=problem)
        super().startService()


def makeService(options: Options, reactor: Any = None) -> StandaloneGateway:
    if reactor is None:
        from twisted.internet import reactor as _reactor

        reactor = _reactor
        own_process = True
    else:
        own_process = False
    log_warnings(options, StandaloneGateway.log)
    gateway = StandaloneGateway(
        reactor,
        options["admin-urls"],
        options["listen_host"],
        options["listen_port"],
        config=options.config(),
        keys=options["keyring"],
        poll_interval=options["poll-interval"],
        metrics_address=options["metrics_address"],
        backlog=options["backlog"],
        admin_tls=options.get("admin_tls"),
        hosts=options["gateway-hosts"],
        max_connections=options["max-connections"],
        gateway_id=options["gateway-id"],
        ceiling=MemoryCeiling(reactor, options["memory-limit"]) if options["memory-limit"] else None,
    )
    if own_process:
        # A process of its own: its start-up heap leaves the collector's
        # scans (llmgw.collector), which embedders' processes are spared.
        collector = CollectorTuning(threshold=None)
        collector.setName("collector")
        collector.setServiceParent(gateway)
        # Memory freed after a burst of connections goes back to the system.
        trimmer = growth_trimmer(reactor)
        if trimmer is not None:
            trimmer.setName("memtrim")
            trimmer.setServiceParent(gateway)
    return gateway
