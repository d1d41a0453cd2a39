"""
``twistd llmgw agent``: the node agent as one C{MultiService}.

    twistd -n llmgw agent --control cp.example:7443 --certs certs --node gpu-07 \\
        [--gpus auto|sim:2x80GiB] [--fabric ib0=10.1.0.7 ...] \\
        [--state-dir agent-state] [--heartbeat 5] \\
        [--model-cache DIR] [--model-cache-size 200GiB]

L{NodeAgent} can be embedded in another Twisted application without twistd:
build it, then C{setServiceParent} it.
"""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

from OpenSSL import SSL
from twisted.application.service import MultiService
from twisted.internet.endpoints import HostnameEndpoint, wrapClientTLS
from twisted.logger import Logger
from twisted.python import usage

from llmgw.addresses import AddressError, format_address, parse_address
from llmgw.agent.client import AgentConfig, AgentCore, make_client_service
from llmgw.agent.gpus import GPUMonitor, GPUSpecError, discover, parse_gpu_spec
from llmgw.agent.modelcache import ModelCacheService
from llmgw.agent.peers import AgentPeers, crl_beside, parse_peer_listen
from llmgw.agent.probe import HttpProber
from llmgw.agent.state import StateDir, StateDirError
from llmgw.agent.supervisor import Supervisor
from llmgw.agent.targets import ControlTargets
from llmgw.options import Options as BaseOptions
from llmgw.options import certs_row, heartbeat_row, log_warnings, model_cache_rows
from llmgw.signals import SighupHandler, owns_signals
from llmgw.tlsconf.options import (
    AgentClientTLS,
    IdentityError,
    TLSConfigError,
    TLSFiles,
    agent_files,
    peer_node_id,
)

DEFAULT_CONTROL_PORT = 7443
#: The agent warns at start when its certificate lapses sooner than this.
CERT_WARN_DAYS = 14


class Options(BaseOptions):
    synopsis = "--control HOST:PORT (--certs DIR --node ID | --ca F --cert F --key F) [options]"
    optParameters = [
        certs_row(None, "directory with ca.pem and agent-NODE.pem/.key (with --node)"),
        ["node", None, None, "node id, to find its files in --certs (must be the certificate's CN)"],
        ["ca", None, None, "the CA certificate (PEM)"],
        ["cert", None, None, "this node's certificate (PEM); its common name is the node id"],
        ["key", None, None, "this node's private key (PEM)"],
        ["gpus", None, "auto", "auto, nvml, nvidia-smi, none, or sim:COUNTxSIZE[:NAME],... (e.g. sim:2x80GiB, sim:2x24GiB:L4,1x80GiB:H100)"],
        ["state-dir", None, "agent-state", "where shard records and logs are kept"],
        heartbeat_row(5.0, "seconds between heartbeats, at most 3600"),
        ["advertise-address", None, "", "the address the gateway and probes reach this node's "
         "shards at, and {host} in commands (default: the local address of the connection to "
         "the control plane)"],
        *model_cache_rows("STATE_DIR/models"),
        ["token", None, None, "the join token (`llmgw ctl token create`), with --join"],
        ["peer-listen", None, "", "[HOST:]PORT to serve this node's cached models to other nodes on, "
         "over mutual TLS with the fleet's certificates (default: not served)"],
    ]

    def __init__(self) -> None:
        super().__init__()
        self["fabrics"] = {}
        self["controls"] = []
        self["joins"] = []

    def opt_control(self, value: str) -> None:
        """
        HOST[:PORT] of the control plane (default port 7443); its certificate
        must name HOST. Repeatable: each member of an HA control plane.
        """
        self["controls"].append(value)

    def opt_join(self, value: str) -> None:
        """
        HOST:PORT of the control plane's join listener: join with --token as
        --node, keeping the files in --certs (default STATE_DIR/certs);
        skipped when they are there. Repeatable, or a comma list: each member
        of an HA control plane, tried in turn.
        """
        self["joins"].extend(value.split(","))

    def opt_fabric(self, value: str) -> None:
        """
        NAME[=ADDRESS] of an interconnect this node is on (repeatable).
        """
        name, _, address = value.partition("=")
        name = name.strip()
        if not name:
            raise usage.UsageError(f"--fabric {value!r}: give NAME or NAME=ADDRESS")
        if name in self["fabrics"]:
            raise usage.UsageError(f"--fabric {name} is given twice")
        self["fabrics"][name] = address.strip()

    def postOptions(self) -> None:
        from llmgw.agent.joinoptions import join_options

        join_options(self)
        self._post_options()

    def _post_options(self) -> None:
        if not self["controls"]:
            raise usage.UsageError("--control HOST:PORT is required: the control plane to dial")
        targets: list[tuple[str, int]] = []
        for given in self["controls"]:
            spec = given.strip()
            if ":" not in spec or (spec.startswith("[") and spec.endswith("]")):
                spec = f"{spec}:{DEFAULT_CONTROL_PORT}"
            try:
                host, port = parse_address(spec, "")
            except AddressError as e:
                raise usage.UsageError(f"--control: {e}") from e
            if not host or not port:
                raise usage.UsageError(f"--control {given!r}: give HOST:PORT")
            if (host, port) in targets:
                raise usage.UsageError(f"--control {given!r} is given twice")
            targets.append((host, port))
        self["control_targets"] = targets
        self["control"] = self["controls"][0]
        self["control_host"], self["control_port"] = targets[0]

        if self["heartbeat"] > 3600:
            raise usage.UsageError("--heartbeat must be between 0 and 3600 seconds")

        from llmgw.engines import advertise_address_problem

        problem = advertise_address_problem(self["advertise-address"].strip())
        if problem:
            raise usage.UsageError(f"--advertise-address: {problem}")
        self["advertise_address"] = self["advertise-address"].strip()
        try:
            self["peer_listen"] = parse_peer_listen(self["peer-listen"])
        except AddressError as e:
            raise usage.UsageError(f"--peer-listen: {e}") from e
        try:
            self["gpu_spec"] = parse_gpu_spec(self["gpus"])
        except GPUSpecError as e:
            raise usage.UsageError(str(e)) from e

        if self.get("joiner") is None:  # a node that joins has no files yet
            files = [self["ca"], self["cert"], self["key"]]
            if any(files) and not all(files):
                raise usage.UsageError("--ca, --cert and --key go together: give all three")
            if not all(files) and not (self["certs"] and self["node"]):
                raise usage.UsageError(
                    "give --certs DIR --node ID, or --ca FILE --cert FILE --key FILE"
                )
            try:
                tls: TLSFiles = agent_files(self["certs"], self["node"], self["ca"], self["cert"],
                                            self["key"])
            except TLSConfigError as e:
                raise usage.UsageError(str(e)) from e
            try:
                node_id = peer_node_id(tls.cert)
            except IdentityError as e:
                raise usage.UsageError(f"certificate {tls.cert_path}: {e}") from e
            if self["node"] and self["node"] != node_id:
                raise usage.UsageError(
                    f"--node {self['node']} does not match certificate {tls.cert_path}, "
                    f"which is for node {node_id!r}"
                )
            self["tls"], self["node_id"] = tls, node_id
            try:
                crl_beside(tls)  # read by the peer listener and the peer fetches
            except TLSConfigError as e:
                raise usage.UsageError(str(e)) from e

        try:
            self["state"] = StateDir(Path(self["state-dir"]))
        except StateDirError as e:
            raise usage.UsageError(str(e)) from e
        self["model_cache"] = Path(self["model-cache"] or self["state"].path / "models")


class NodeAgent(MultiService):
    """
    The agent's parts: C{monitor} (GPUs), C{supervisor} (shards), C{core}
    (the stream's state) and the C{ClientService} that dials.
    """

    log = Logger()

    def __init__(
        self,
        reactor: Any,
        tls: TLSFiles,
        node_id: str,
        control_host: str,
        control_port: int,
        state: StateDir,
        gpu_source: Any,
        fabrics: dict[str, str] | None = None,
        heartbeat: float = 5.0,
        handle_sighup: bool | None = None,
        advertise_address: str = "",
        other_controls: list[tuple[str, int]] | None = None,
        model_cache: Path | None = None,
        model_cache_size: int | None = None,
        peer_listen: tuple[str, int] | None = None,
        renew_fraction: float | None = None,
        tls_context: SSL.Context | None = None,
    ):
        super().__init__()
        self.reactor = reactor
        self.tls = tls
        self.state = state
        self.node_id = node_id
        self.control = format_address(control_host, control_port)
        self.monitor = GPUMonitor(gpu_source, reactor, interval=heartbeat)
        self.monitor.setServiceParent(self)
        # The node's model cache (STATE_DIR/models by default), its size
        # bound by default what its filesystem has free at start, less a margin.
        # The peer listener serves the cache's complete models to other
        # nodes, and fetches given peers try them before the source.
        self.peers = AgentPeers(reactor, tls, peer_listen)
        self.model_cache = ModelCacheService(reactor, model_cache or state.path / "models",
                                             model_cache_size, peering=self.peers.peering)
        self.model_cache.setServiceParent(self)
        self.peers.serve(self.model_cache.cache)
        self.supervisor = Supervisor(
            reactor,
            lambda *a, **kw: reactor.spawnProcess(*a, **kw),
            state,
            gpu_indices=[g.index for g in self.monitor.gpus()],
            prober=HttpProber(reactor),
            cache=self.model_cache.cache,
        )
        self.supervisor.setServiceParent(self)
        # engines: engine signals for the heartbeats
        from llmgw.agent.scrape import HttpFetcher, Scraper

        self.fetcher = HttpFetcher(reactor)
        self.scraper = Scraper(reactor, self.supervisor, self.fetcher.get,
                               host=lambda: self.supervisor.probe_host)
        self.scraper.setServiceParent(self)
        from llmgw.agent.sleep import Sleeper

        self.sleeper = Sleeper(reactor, self.supervisor, self.scraper, self.fetcher.call,
                               host=lambda: self.supervisor.probe_host)
        self.scraper.sleep_state = self.sleeper.state_of
        self.scraper.sleep_refused = self.sleeper.take_refusal
        self.supervisor.lends = self.sleeper.lends
        self.supervisor.confirm = self.sleeper.confirm
        self.supervisor.add_listener(self.sleeper.reported)
        self.sleeper.setServiceParent(self)
        not_after = tls.cert.not_valid_after_utc
        self.core = AgentCore(
            AgentConfig(
                node_id=node_id,
                control=self.control,
                fabrics=dict(fabrics or {}),
                heartbeat_interval=heartbeat,
                certificate_not_after=int(not_after.timestamp()),
                advertise_address=advertise_address,
            ),
            self.supervisor,
            self.monitor,
            reactor,
            epoch_file=state.path / "epoch",
            scraper=self.scraper,
            model_cache=self.model_cache.cache,
        )
        self.sleeper.on_change = lambda shard_id: self.core.heartbeat_now()
        self.core.sleep_shard = self.sleeper.sleep_now
        # tls_context: one made before the files existed (a node that joined).
        self.client_tls = AgentClientTLS(control_host, tls, context=tls_context)
        self.handle_sighup = owns_signals(reactor) if handle_sighup is None else handle_sighup
        self._sighup = SighupHandler(reactor, self.reload_certificate, "this node's certificate")
        # HA: every member given; one TLS creator per host, as
        # each checks that the certificate names the host dialled.
        self._client_tls: dict[str, AgentClientTLS] = {control_host.strip("[]"): self.client_tls}
        self.targets = ControlTargets(
            [(control_host, control_port), *(other_controls or [])],
            lambda host, port: wrapClientTLS(
                self._tls_for(host), HostnameEndpoint(reactor, host, port, timeout=10)
            ),
            on_target=self._dialling,
        )
        self.core.targets = self.targets
        # Renewal over the stream: a control plane that issues none says so
        # in an Ack, which only the log sees.
        from llmgw.agent.renewal import CertificateRenewal, fraction_from_env, stream_sender

        self.renewal = CertificateRenewal(
            reactor, node_id, lambda: self.tls, stream_sender(self.core), self.reload_certificate,
            fraction=renew_fraction if renew_fraction is not None else fraction_from_env())
        self.renewal.setServiceParent(self)
        self.core.renewal = self.renewal
        # Before the client: the listener's port is known when Register is sent.
        self.peers.setServiceParent(self)
        self.core.peer_address = self.peers.reported
        self.client = make_client_service(self.core, self.targets)
        self.client.setServiceParent(self)

    def _tls_for(self, host: str) -> AgentClientTLS:
        key = host.strip("[]")
        creator = self._client_tls.get(key)
        if creator is None:
            creator = self._client_tls[key] = AgentClientTLS(key, self.tls)
        return creator

    def _dialling(self, address: str) -> None:
        self.control = address
        self.core.config.control = address

    def startService(self) -> None:
        self.state.lock()
        not_after = self.tls.cert.not_valid_after_utc
        left = not_after - datetime.datetime.now(datetime.UTC)
        if left < datetime.timedelta(days=CERT_WARN_DAYS):
            self.log.warn("this node's certificate {path} expires on {when}: it renews over its "
                          "stream once the control plane signs it (or an operator approves it with "
                          "`llmgw ctl csr approve {node}`)", path=str(self.tls.cert_path),
                          when=not_after.isoformat(), node=self.node_id)
        self.log.info(
            "agent {node} starting: control plane {control}, {gpus}, state in {state}",
            node=self.node_id, control=self.control, gpus=self.monitor.source.describe(),
            state=str(self.state.path),
        )
        if self.handle_sighup:
            self._sighup.install()
        # The cache's index is read in its threads; fetches wait for it.
        self.supervisor.weights.load()
        # Re-adopt before dialling, so the first Register lists what still runs
        # (and the models of what runs are pinned before any fetch).
        self.supervisor.recover()
        self.core.newest_epoch = max(self.core.newest_epoch, self.core._load_epoch())
        super().startService()

    def reload_certificate(self) -> bool:
        """
        Read this node's certificate, key and CA again (after a renewal) and
        present them from the next connection on; the open stream carries on.
        Bad, half-written or mismatched files, or a certificate for another
        node, are refused and the running ones stay.

        @return: whether the new files were taken.
        """
        try:
            files = self.client_tls.reload()
            for creator in self._client_tls.values():
                if creator is not self.client_tls:
                    creator.reload(files)
        except TLSConfigError as e:
            self.log.error("certificate reload refused, the running certificate stays: {error}",
                           error=str(e))
            return False
        try:
            self.peers.reload(files)
        except TLSConfigError as e:
            self.log.error("the peer listener keeps its running certificate and CRL: {error}", error=str(e))
        self.tls = files
        self.core.config.certificate_not_after = int(files.cert.not_valid_after_utc.timestamp())
        self.log.info(
            "certificate reloaded from {path}: serial {serial}, valid until {when}; "
            "used from the next connection",
            path=str(files.cert_path), serial=format(files.cert.serial_number, "x"),
            when=files.cert.not_valid_after_utc.isoformat(),
        )
        return True

    def stopService(self) -> Any:
        self._sighup.uninstall()
        self.core.stopping = True
        self.fetcher.close()  # engines: kept-alive scrape connections
        d = super().stopService()

        def unlock(result: Any) -> Any:
            self.state.unlock()
            return result

        return d.addBoth(unlock)


def makeService(options: Options, reactor: Any = None) -> Any:
    log_warnings(options, NodeAgent.log)
    if reactor is None:
        from twisted.internet import reactor as _reactor

        reactor = _reactor
    if options.get("joiner") is not None:
        from llmgw.agent.joinoptions import joining_service

        return joining_service(options, reactor)
    try:
        source = discover(options["gpu_spec"], reactor, salt=options["node_id"])
    except GPUSpecError as e:
        raise usage.UsageError(str(e)) from e
    return NodeAgent(
        reactor,
        tls=options["tls"],
        node_id=options["node_id"],
        control_host=options["control_host"],
        control_port=options["control_port"],
        state=options["state"],
        gpu_source=source,
        fabrics=options["fabrics"],
        heartbeat=options["heartbeat"],
        advertise_address=options["advertise_address"],
        other_controls=options["control_targets"][1:],
        model_cache=options["model_cache"],
        model_cache_size=options["model-cache-size"],
        peer_listen=options["peer_listen"],
        # Taken, not read: a context presents one identity, once.
        tls_context=options.pop("tls_context", None),
    )
