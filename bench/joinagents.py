"""
Simulated agents that join before they connect: the machinery of
L{bench.simagents} (many agents in one process, real mutual TLS, the real
agent stream), except that an agent starts with no certificate. At its dial
time it runs the agent's own L{llmgw.agent.join.Joiner}: it makes its key on
the "node" (written 0600 in a directory of its own), dials the control
plane's join listener, checks the chain it is shown against the token's CA
hash before it sends anything, sends its certificate request and writes the
certificate and CA bundle it gets back. Then it dials the agent port with
that certificate, as L{bench.simagents} agents do, and registers.

What a real node does when it starts, before it joins, is done here before
the storm's clock: each agent's L{Joiner} (with its join TLS context and its
agent stream's context, without an identity yet) is made when this process
starts, as C{twistd llmgw agent --join} makes it when it parses its options.
Everything from the key on is in the clock, the issued files' loading into
that context among it.

Requests from the orchestrator are those of L{bench.simagents}; C{storm}
also takes C{join_port} and reports, per agent, when its join finished
(C{joined_ns}), how many join requests it sent (C{join_asks}) and the
errors a join met.

With C{--floor} (and C{--certs}) the agents are instead pre-issued ones
that open the join's connection and nothing more: at its dial time each
dials the join listener with the joiner's TLS context, checks the chain
against the token's CA hash as a join does, and closes without sending a
request (C{joined_ns}: when that connection closed); then it dials the agent
port and registers. No join on a connection of its own can cost less than
this: what a join adds to a registration beyond it is the request itself.

Run by L{bench.join}; not meant to be started by hand.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IHandshakeListener
from twisted.internet.protocol import ClientFactory, Protocol
from twisted.internet.stdio import StandardIO
from twisted.protocols.tls import TLSMemoryBIOFactory
from twisted.python.failure import Failure
from zope.interface import implementer

from bench.common import ControlChannel, raise_nofile
from bench.simagents import Fleet, SimNode, load_nodes, register_message
from llmgw.agent.join import Joiner, _UnverifiedTLS, check_chain, join_context
from llmgw.api.v1 import agent_pb2 as pb
from llmgw.tlsconf.jointoken import ParsedToken, parse_token
from llmgw.tlsconf.options import AgentClientTLS, TLSFiles


class CountingJoiner(Joiner):
    """The agent's joiner, counting the requests it sends."""

    asks = 0

    def ask_once(self) -> Deferred[pb.JoinResponse]:
        self.asks += 1
        return super().ask_once()


class JoinNode(SimNode):
    """A simulated agent with no certificate until it has joined."""

    def __init__(self, node_id: str, joiner: CountingJoiner) -> None:
        super().__init__(node_id, None, register_message(node_id, 0))  # type: ignore[arg-type]
        self.joined_ns = 0
        self.joiner = joiner
        self.joining = False


class JoinFleet(Fleet):
    """A L{Fleet} whose agents join (once) before their first dial."""

    def __init__(self, reactor: Any, nodes: list[JoinNode], heartbeat_interval: float,
                 token: ParsedToken) -> None:
        super().__init__(reactor, list(nodes), heartbeat_interval)
        self.join_nodes = nodes
        self.token = token
        self.join_port = 0
        self.join_errors: dict[str, int] = {}

    def dial(self, node: SimNode) -> None:
        assert isinstance(node, JoinNode)
        if node.creator is not None or self.closing:
            super().dial(node)
            return
        if node.joining:
            return
        node.joining = True
        if not node.dial_ns:
            node.dial_ns = time.monotonic_ns()
        node.joiner.reactor = self.reactor
        node.joiner.host, node.joiner.port = self.host, self.join_port
        node.joiner.addresses = [(self.host, self.join_port)]
        d = Deferred.fromCoroutine(node.joiner.run())
        d.addCallbacks(lambda files: self._joined(node, files), lambda f: self._failed(node, f))

    def _joined(self, node: JoinNode, files: TLSFiles) -> None:
        node.joined_ns = time.monotonic_ns()
        # As the agent does (llmgw.agent.joinoptions): its context, made
        # with the joiner, given the files.
        node.creator = AgentClientTLS("127.0.0.1", files, context=node.joiner.agent_context)
        # Built before the clock, as the pre-issued agents' is; only the
        # certificate's end is the join's.
        msg = pb.AgentMessage.FromString(node.register)
        msg.register.certificate_not_after = int(files.cert.not_valid_after_utc.timestamp())
        node.register = msg.SerializeToString()
        super().dial(node)

    def _failed(self, node: JoinNode, f: Failure) -> None:
        why = f.getErrorMessage()[:120]
        self.join_errors[why] = self.join_errors.get(why, 0) + 1

    def op_storm(self, req: dict[str, Any]) -> Deferred[dict[str, Any]]:
        self.join_port = int(req["join_port"])
        self.join_errors = {}

        def more(report: dict[str, Any]) -> dict[str, Any]:
            report["joined_ns"] = [n.joined_ns for n in self.join_nodes]
            report["join_asks"] = [n.joiner.asks for n in self.join_nodes]
            report["join_errors"] = self.join_errors
            return report

        return super().op_storm(req).addCallback(more)


@implementer(IHandshakeListener)
class Touch(Protocol):
    """The join's connection without the join: handshake, the chain checked, closed."""

    transport: Any

    def __init__(self, fleet: FloorFleet, node: SimNode) -> None:
        self.fleet = fleet
        self.node = node
        self.error = ""
        self.shaken = False

    def handshakeCompleted(self) -> None:
        self.shaken = True
        chain = self.transport.getHandle().get_peer_cert_chain() or []
        try:
            check_chain([c.to_cryptography() for c in chain], self.fleet.host, self.fleet.token.ca_hash)
        except Exception as e:
            self.error = str(e)[:120]
        self.transport.loseConnection()

    def connectionLost(self, reason: Failure = Failure(ConnectionError())) -> None:  # noqa: B008
        if not self.shaken and not self.error:
            self.error = f"closed before the handshake was done: {reason.getErrorMessage()[:80]}"
        self.fleet.touched(self.node, self.error)


class TouchFactory(ClientFactory):
    def __init__(self, fleet: FloorFleet, node: SimNode) -> None:
        self.fleet = fleet
        self.node = node

    def buildProtocol(self, addr: Any) -> Touch:
        return Touch(self.fleet, self.node)

    def clientConnectionFailed(self, connector: Any, reason: Failure) -> None:
        self.fleet.touched(self.node, reason.getErrorMessage()[:120])


class FloorFleet(Fleet):
    """Pre-issued agents that open (and close) a join connection before their first dial."""

    def __init__(self, reactor: Any, nodes: list[SimNode], heartbeat_interval: float,
                 token: ParsedToken) -> None:
        super().__init__(reactor, nodes, heartbeat_interval)
        self.token = token
        self.join_port = 0
        self.join_errors: dict[str, int] = {}
        # One context for the fleet: a joiner makes its own when it starts.
        self.context = join_context()
        self._touched: dict[str, int] = {}

    def dial(self, node: SimNode) -> None:
        if node.node_id in self._touched or self.closing:
            super().dial(node)
            return
        self._touched[node.node_id] = 0
        if not node.dial_ns:
            node.dial_ns = time.monotonic_ns()
        factory = TLSMemoryBIOFactory(_UnverifiedTLS(self.host, self.context), True, TouchFactory(self, node))
        self.reactor.connectTCP(self.host, self.join_port, factory, timeout=30)

    def touched(self, node: SimNode, error: str) -> None:
        if self._touched.get(node.node_id):
            return
        self._touched[node.node_id] = time.monotonic_ns()
        if error:
            self.join_errors[error] = self.join_errors.get(error, 0) + 1
        super().dial(node)

    def op_storm(self, req: dict[str, Any]) -> Deferred[dict[str, Any]]:
        self.join_port = int(req["join_port"])
        self.join_errors = {}
        self._touched = {}

        def more(report: dict[str, Any]) -> dict[str, Any]:
            report["joined_ns"] = [self._touched.get(n.node_id, 0) for n in self.nodes]
            report["join_asks"] = [0 for _ in self.nodes]
            report["join_errors"] = self.join_errors
            return report

        return super().op_storm(req).addCallback(more)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--nodes-dir", type=Path, help="each agent's state directory is NODES_DIR/NODE")
    p.add_argument("--floor", action="store_true",
                   help="pre-issued agents (from --certs) that open and close a join connection first")
    p.add_argument("--certs", type=Path, help="with --floor: the pre-issued certificates")
    p.add_argument("--token", required=True)
    p.add_argument("--prefix", default="join-")
    p.add_argument("--first", type=int, required=True)
    p.add_argument("--count", type=int, required=True)
    p.add_argument("--heartbeat-interval", type=float, default=5.0)
    args = p.parse_args(argv)

    from twisted.internet import epollreactor

    epollreactor.install()
    from twisted.internet import reactor

    nofile = raise_nofile()
    ids = [f"{args.prefix}{i:05d}" for i in range(args.first, args.first + args.count)]
    token = parse_token(args.token)
    # The join listener's address is known at the storm: port 0 until then.
    fleet: Fleet
    if args.floor:
        fleet = FloorFleet(reactor, load_nodes(args.certs, ids), args.heartbeat_interval, token)
    else:
        nodes = [JoinNode(i, CountingJoiner(reactor, "127.0.0.1", 0, token, i, args.nodes_dir / i))
                 for i in ids]
        fleet = JoinFleet(reactor, nodes, args.heartbeat_interval, token)

    def stop() -> None:
        if reactor.running:
            reactor.stop()

    hello = {"ready": True, "agents": len(ids), "load_s": 0.0, "nofile": nofile}
    StandardIO(ControlChannel(fleet.handlers(), hello, stop))
    reactor.run()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
