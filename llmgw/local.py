"""
``twistd llmgw local`` (or ``llmgw local``): the whole system on one
machine.

A control plane with its agent port on loopback, N agents with simulated
GPUs (each with its own certificate and state directory, each on a real
mutual-TLS stream, each serving its model cache to the others on a free
loopback port), a demo catalog whose shards run the fake model server,
the gateway and the admin API. Dev certificates are made in C{./certs} on the
first run and reused afterwards. Stopping it stops every shard it started.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, TextIO

from twisted.application.service import MultiService
from twisted.internet.defer import inlineCallbacks
from twisted.internet.task import LoopingCall, deferLater
from twisted.logger import Logger
from twisted.python import usage

import llmgw
from llmgw.addresses import ListenRefused, format_address
from llmgw.agent.gpus import GPUSpecError, discover, parse_gpu_spec
from llmgw.agent.service import NodeAgent
from llmgw.agent.state import StateDir, StateDirError
from llmgw.agent.stopping import KILL_WAIT_S
from llmgw.control import service as control_service
from llmgw.control.shell.reconciler import Reconciler
from llmgw.options import Options as BaseOptions
from llmgw.options import (
    api_keys_row,
    certs_row,
    heartbeat_row,
    listen_address,
    log_warnings,
    model_cache_rows,
    positive_int,
)
from llmgw.tlsconf.ca import CertificateAuthority
from llmgw.tlsconf.options import (
    ServerIdentityError,
    TLSConfigError,
    TLSFiles,
    verify_server_identity,
)
from llmgw.tlsconf.pem import CAError

#: The demo catalog, shipped in the package; see L{demo_catalog}.
DEMO_CATALOG = Path(__file__).with_name("demo-catalog.toml")
SERVER_HOSTS = ("127.0.0.1", "localhost", "::1")


class LocalError(Exception):
    """
    The local fleet cannot start; the message says why and what to do.
    """


def node_ids(count: int) -> list[str]:
    return [f"local-{i}" for i in range(1, count + 1)]


def ensure_certs(directory: Path, nodes: list[str]) -> list[str]:
    """
    Make the dev CA, the control plane's certificate and each node's in
    C{directory} if they are missing; check and reuse those that are there.
    Returns what was made, for the log.

    @raise LocalError: a file is damaged, expired, or from another CA.
    """
    made: list[str] = []
    ca_pem, ca_key = directory / "ca.pem", directory / "ca.key"
    if not ca_pem.exists() and not ca_key.exists():
        stray = sorted(p.name for p in directory.glob("*.pem")) if directory.exists() else []
        if stray:
            raise LocalError(
                f"{directory} holds certificates ({', '.join(stray)}) but no CA; "
                "move them away or pass --certs with another directory"
            )
        CertificateAuthority.init(directory, name="llmgw local dev CA")
        made.append("CA")
    try:
        ca = CertificateAuthority.load(directory)
    except CAError as e:
        raise LocalError(f"the dev CA in {directory} is damaged: {e}") from e

    def check(stem: str, what: str) -> TLSFiles | None:
        if not (directory / f"{stem}.pem").exists():
            return None
        try:
            return TLSFiles.load(ca_pem, directory / f"{stem}.pem", directory / f"{stem}.key")
        except TLSConfigError as e:
            raise LocalError(
                f"{what} in {directory} cannot be used: {e}. Delete {directory} to start "
                "over with new dev certificates, or pass --certs with another directory"
            ) from e

    server = check("server", "the control plane's certificate")
    if server is None:
        ca.issue_server(SERVER_HOSTS)
        made.append("server certificate")
    else:
        try:
            verify_server_identity(server.cert, "127.0.0.1")
        except ServerIdentityError as e:
            raise LocalError(f"{directory}/server.pem: {e}") from e
    for node in nodes:
        if check(f"agent-{node}", f"node {node}'s certificate") is None:
            ca.issue_agent(node)
            made.append(f"certificate for {node}")
    return made


def demo_catalog(state_dir: Path) -> Path:
    """
    Write the demo catalog into C{state_dir}, with C{PYTHONPATH} set so the
    fake model server imports this copy of llmgw however it was installed.
    """
    root = str(Path(llmgw.__file__).resolve().parent.parent)
    text = DEMO_CATALOG.read_text()
    if "env = {}" not in text:
        raise LocalError(f"{DEMO_CATALOG} has no 'env = {{}}' line to fill in")
    text = text.replace("env = {}", f"env = {{ PYTHONPATH = {json.dumps(root)} }}", 1)
    path = state_dir / "demo-catalog.toml"
    path.write_text(text)
    return path


def agent_cache(options: usage.Options, node: str) -> Path | None:
    """
    Where agent C{node}'s model cache is: C{--model-cache DIR}/NODE (each
    agent has a cache of its own), or C{None} for the agent's default,
    its state directory's C{models}.
    """
    given = options["model-cache"]
    return Path(given).resolve() / node if given else None


def _agent_count(value: str) -> int:
    n = positive_int(value)
    if n > 64:
        raise ValueError(f"must be between 1 and 64, not {n}")
    return n  # type: ignore[no-any-return]


_agent_count.coerceDoc = "Between 1 and 64."  # type: ignore[attr-defined]

#: The local control plane's adoption grace at most, in seconds; it ends
#: sooner, once every local agent has registered.
LOCAL_GRACE_S = 10
#: The local fleet's caps: agent-port connections (at least) and gateway clients.
LOCAL_MIN_CONNECTIONS = 64
LOCAL_GATEWAY_CONNECTIONS = 4096

#: The control plane's option for each listener, and local's name for it
#: (the same names today: a refused listener names what the user typed).
LISTENER_OPTIONS = {"--agent-listen": "--agent-listen", "--admin": "--admin", "--gateway": "--gateway"}


class Options(BaseOptions):
    aliases = {"agent-port": "agent-listen"}
    optParameters = [
        ["agents", "n", 2, "how many agents (simulated GPU nodes)", _agent_count],
        ["gpus", None, "sim:2x24GiB", "each agent's GPUs (sim:COUNTxSIZE[:NAME],...)"],
        ["catalog", None, None, "catalog TOML (default: the demo catalog on the fake model server)"],
        certs_row("certs", "where the dev CA and certificates are made and kept"),
        ["state-dir", None, "local-state", "where each agent keeps its state"],
        ["gateway", None, "127.0.0.1:8000", "[HOST:]PORT the OpenAI-compatible gateway listens on"],
        api_keys_row("the gateway's API keys file"),
        ["admin", None, "127.0.0.1:7480", "[HOST:]PORT the admin API and /metrics listen on"],
        ["agent-listen", None, "127.0.0.1:0", "[HOST:]PORT the agent stream listens on (0: any free port)"],
        heartbeat_row(2.0, "agents' heartbeat interval, seconds"),
        # Each agent has a cache of its own: DIR/NODE.
        *model_cache_rows("STATE_DIR/agent-NODE/models; with DIR, DIR/NODE for each agent"),
    ]

    def postOptions(self) -> None:
        try:
            self["gpu_spec"] = parse_gpu_spec(self["gpus"])
        except GPUSpecError as e:
            raise usage.UsageError(f"--gpus: {e}") from e
        if not self["gpus"].startswith("sim:"):
            raise usage.UsageError("--gpus: the local fleet simulates its GPUs: use sim:COUNTxSIZE")
        for name in ("gateway", "admin", "agent-listen"):
            address = listen_address(self, name, "127.0.0.1")
            assert address is not None
            self[name] = format_address(*address)
        self["certs"] = Path(self["certs"]).resolve()
        self["state-dir"] = Path(self["state-dir"]).resolve()
        try:
            self["made"] = ensure_certs(self["certs"], node_ids(self["agents"]))
        except (LocalError, CAError) as e:
            raise usage.UsageError(str(e)) from e
        self["state-dir"].mkdir(parents=True, exist_ok=True)
        catalog = self["catalog"] or demo_catalog(self["state-dir"])
        self["control"] = control_service.Options()
        try:
            self["control"].parseOptions([
                "--certs", str(self["certs"]),
                "--agent-listen", self["agent-listen"],
                "--admin", self["admin"],
                "--gateway", self["gateway"],
                "--catalog", str(catalog),
                "--heartbeat", str(self["heartbeat"]),
                # Every agent is on this machine: the grace ends as soon
                # as all of them have registered (LocalFleet), and this is
                # only its bound, for agents that do not come.
                "--adoption-grace", str(LOCAL_GRACE_S),
                "--max-connections-per-address", "0",
                # A fleet on one machine needs a few agent and client
                # connections, not a data centre's: sized so, it fits the
                # open-file limit a desktop has and says nothing about it.
                "--max-connections", str(max(LOCAL_MIN_CONNECTIONS, 4 * self["agents"])),
                "--gateway-max-connections", str(LOCAL_GATEWAY_CONNECTIONS),
                *(["--api-keys", str(Path(self["api-keys"]).resolve())] if self["api-keys"] else []),
            ])
        except usage.UsageError as e:
            raise usage.UsageError(f"the control plane refused its options: {e}") from e


class LocalFleet(MultiService):
    """
    A control plane and C{agents} agents in one process. C{control} is the
    L{ControlPlane}; C{agents} fills in once the agent port is bound.
    """

    log = Logger()

    def __init__(self, reactor: Any, options: Options, out: TextIO | None = None):
        super().__init__()
        self.reactor = reactor
        self.options = options
        self.out = out if out is not None else sys.stdout
        self.control = control_service.makeService(options["control"], reactor=reactor)
        self.control.setServiceParent(self)
        self.agents: list[NodeAgent] = []
        self._watch: LoopingCall | None = None
        self.announced = False
        self.grace_ended = False

    def startService(self) -> None:
        if self.options["made"]:
            self.log.info("made dev certificates in {dir}: {what}", dir=str(self.options["certs"]),
                          what=", ".join(self.options["made"]))
        try:
            super().startService()
        except ListenRefused as e:
            # Name the option of this command, not the control plane's.
            raise e.renamed(LISTENER_OPTIONS.get(e.option or "", e.option)) from None
        host, port = self.control.agent_listener.address()
        certs = self.options["certs"]
        for node in node_ids(self.options["agents"]):
            state = StateDir(self.options["state-dir"] / f"agent-{node}")
            agent = NodeAgent(
                self.reactor,
                tls=TLSFiles.load(certs / "ca.pem", certs / f"agent-{node}.pem",
                                  certs / f"agent-{node}.key"),
                node_id=node,
                control_host=host,
                control_port=port,
                state=state,
                gpu_source=discover(self.options["gpu_spec"], self.reactor, salt=node),
                heartbeat=self.options["heartbeat"],
                handle_sighup=False,
                model_cache=agent_cache(self.options, node),
                model_cache_size=self.options["model-cache-size"],
                # Each agent serves its cache to the others on a free
                # loopback port, so the local fleet shares weights as a
                # real one does.
                peer_listen=("127.0.0.1", 0),
            )
            agent.setName(f"agent-{node}")
            agent.setServiceParent(self)
            self.agents.append(agent)
        self._watch = LoopingCall(self._check_ready)
        self._watch.clock = self.reactor
        self._watch.start(0.5, now=False)

    def _check_ready(self) -> None:
        reconciler = self.control.reconciler
        if reconciler is None or self.announced:
            return
        if not self.grace_ended and reconciler.connected() >= {a.node_id for a in self.agents}:
            # Every local agent has registered and said what it runs: place
            # now, spread over all of them, rather than on whichever came
            # first (a slow start under load used to put both replicas on
            # one node).
            self.grace_ended = True
            reconciler.end_adoption_grace("every local agent has registered")
        deployments = reconciler.deployments()
        if not deployments or any(d["ready"] < d["desired"] for d in deployments):
            return
        self.announced = True
        self.out.write(self.summary())
        self.out.flush()

    def summary(self) -> str:
        """
        What runs where, and how to call it.
        """
        reconciler = self.control.reconciler
        assert reconciler is not None
        lines = ["", "llmgw local fleet is ready:"]
        for rep in reconciler.replicas():
            for shard in rep["shards"]:
                lines.append(
                    f"  replica {rep['id']:<24} {rep['state']:<8} {shard['node']:<10} "
                    f"{shard['address']}   model {rep['model']}"
                )
        gateway = self.control.gateway
        gw = format_address(*gateway.listener.address()) if gateway is not None else None
        admin = self.control.admin_listener
        adm = format_address(*admin.address()) if admin is not None else None
        lines.append(f"  gateway http://{gw}/v1   admin http://{adm}   "
                     f"certificates {self.options['certs']}")
        models = [d["model"] for d in reconciler.deployments()]
        if gw and models:
            body = json.dumps(
                {"model": models[0], "messages": [{"role": "user", "content": "hello"}]}
            )
            lines.append("try:")
            lines.append(
                f"  curl -s http://{gw}/v1/chat/completions "
                f"-H 'Content-Type: application/json' -d '{body}'"
            )
            lines.append(f"  llmgw ctl replicas --admin-url http://{adm}")
        lines.append("Ctrl-C stops the fleet and every shard it started.")
        return "\n".join(lines) + "\n\n"

    @inlineCallbacks
    def stopService(self) -> Any:
        if self._watch is not None and self._watch.running:
            self._watch.stop()
        # First stop deciding, so nothing is replaced while shards stop,
        # and say that their stops are this shutdown's, not news.
        reconciler = self.control.reconciler
        if reconciler is not None:
            if reconciler.running:
                yield reconciler.stopService()
            stops_expected(reconciler)
        yield self.stop_shards()
        yield super().stopService()

    @inlineCallbacks
    def stop_shards(self, poll: float = 0.1) -> Any:
        """
        Stop every shard the agents run (TERM to each process group, then
        KILL after each shard's grace) and wait until every shard's process
        group is empty, children included. A group that survives its KILL
        for L{KILL_WAIT_S} more is named in a loud log line, and the wait
        ends.
        """
        grace = 0.0
        for agent in self.agents:
            for shard in agent.supervisor.held_shards():
                grace = max(grace, shard.spec.stop_grace_s)
                if shard.live:
                    agent.supervisor.stop(shard.shard_id)
        deadline = self.reactor.seconds() + grace + KILL_WAIT_S
        while any(a.supervisor.held_shards() for a in self.agents):
            if self.reactor.seconds() > deadline:
                left = [f"{s.shard_id} (groups {sorted(s.pgids)})"
                        for a in self.agents for s in a.supervisor.held_shards()]
                self.log.critical("shard processes still running after their grace and "
                                  "KILL: {shards}", shards=", ".join(left))
                break
            yield deferLater(self.reactor, poll, lambda: None)


def stops_expected(reconciler: Reconciler) -> None:
    """
    Mark every shard C{reconciler} holds as stopping: the local fleet stops
    them itself at shutdown, behind the control plane's back, and their
    C{stopped} reports then end them quietly instead of being logged as
    shards that stopped without being told to.
    """
    state, now = reconciler.state, reconciler.clock.seconds()
    for shard in list(state.shards.values()):
        if not shard.stopping:
            state.mark_stopping(shard, now)


def makeService(options: Options, reactor: Any = None) -> LocalFleet:
    log_warnings(options, LocalFleet.log)
    if reactor is None:
        from twisted.internet import reactor as _reactor

        reactor = _reactor
    try:
        for node in node_ids(options["agents"]):
            StateDir(options["state-dir"] / f"agent-{node}")
    except StateDirError as e:
        raise usage.UsageError(str(e)) from e
    return LocalFleet(reactor, options)


__all__ = ["LocalFleet", "Options", "ensure_certs", "makeService", "stops_expected"]
