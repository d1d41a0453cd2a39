"""
Test tools for TLS, made at run time by llmgw's own CA code: a CA directory
with a server and node certificates, certificates the CLI would never issue,
a minimal registering agent (a test client, not the agent process), and
in-memory mutual-TLS connections.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from twisted.internet.address import IPv4Address
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.internet.protocol import ClientFactory
from twisted.protocols.tls import TLSMemoryBIOFactory
from twisted.python.failure import Failure
from twisted.test import iosim

from llmgw.api.v1 import agent_pb2 as pb
from llmgw.tlsconf.ca import CertificateAuthority
from llmgw.tlsconf.certs import LEAF_KEY_USAGE, random_serial
from llmgw.tlsconf.options import AgentClientTLS, agent_files
from llmgw.tlsconf.pem import cert_pem, key_pem, write_private
from llmgw.wire import PROTOCOL_VERSION, MessageStream


def make_pki(
    directory: str | Path, nodes: Iterable[str] = ("node-a", "node-b"),
    server_hosts: Iterable[str] = ("127.0.0.1", "localhost"),
) -> CertificateAuthority:
    """
    A CA in C{directory} with a server certificate for C{server_hosts} and
    an agent certificate per node.
    """
    ca = CertificateAuthority.init(directory)
    ca.issue_server(server_hosts)
    for node in nodes:
        ca.issue_agent(node)
    return ca


def issue_raw(
    ca: CertificateAuthority,
    stem: str,
    common_name: str,
    usage: x509.ObjectIdentifier | None = ExtendedKeyUsageOID.CLIENT_AUTH,
    not_before: datetime.datetime | None = None,
    not_after: datetime.datetime | None = None,
    sans: list[x509.GeneralName] | None = None,
    key_usage: x509.KeyUsage | None = LEAF_KEY_USAGE,
    extra_usages: Iterable[x509.ObjectIdentifier] = (),
) -> tuple[Path, Path]:
    """
    Issue a certificate the CLI would never issue (expired, no usage, odd
    names, a key usage other than digitalSignature, or none), for tests of
    what the verifiers refuse. Returns the cert and key paths.
    """
    now = datetime.datetime.now(datetime.UTC)
    key = ec.generate_private_key(ec.SECP256R1())
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .issuer_name(ca.certificate.subject)
        .public_key(key.public_key())
        .serial_number(random_serial())
        .not_valid_before(not_before or now - datetime.timedelta(minutes=5))
        .not_valid_after(not_after or now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
    )
    if key_usage is not None:
        builder = builder.add_extension(key_usage, critical=True)
    usages = ([usage] if usage is not None else []) + list(extra_usages)
    if usages:
        builder = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    cert = builder.sign(ca.key, hashes.SHA256())
    cert_path = ca.directory / f"{stem}.pem"
    key_path = ca.directory / f"{stem}.key"
    cert_path.write_bytes(cert_pem(cert))
    write_private(key_path, key_pem(key))
    return cert_path, key_path


class RegisteringAgent(MessageStream[pb.ControlMessage]):
    """
    A minimal agent for tests: sends a C{Register} for C{node_id} as soon as
    it is connected (TLS holds it until the handshake is done) and records
    what the control plane sends back.
    """

    incoming = pb.ControlMessage

    def __init__(self, node_id: str, certificate_not_after: int = 0):
        self.node_id = node_id
        self.certificate_not_after = certificate_not_after
        self.received: list[pb.ControlMessage] = []
        self.lost: Failure | None = None
        self.connected = False
        #: Fires with the register Ack (ok or not).
        self.acked: Deferred[pb.Ack] = Deferred()
        #: Fires when the connection is gone.
        self.closed: Deferred[None] = Deferred()

    def connectionMade(self) -> None:
        self.connected = True
        self.send_message(
            pb.AgentMessage(
                register=pb.Register(
                    protocol_version=PROTOCOL_VERSION,
                    node_id=self.node_id,
                    agent_version="test",
                    certificate_not_after=self.certificate_not_after,
                )
            )
        )

    def heartbeat(self) -> None:
        self.send_message(pb.AgentMessage(heartbeat=pb.Heartbeat()))

    def message_received(self, msg: pb.ControlMessage) -> None:
        self.received.append(msg)
        if msg.WhichOneof("msg") == "ack" and msg.ack.message_id == "register" and not self.acked.called:
            self.acked.callback(msg.ack)

    def frame_refused(self, reason: str) -> None:
        self.transport.abortConnection()  # type: ignore[union-attr]

    def connectionLost(self, reason: Failure = Failure(ConnectionError())) -> None:  # noqa: B008
        self.connected = False
        self.lost = reason
        if not self.closed.called:
            self.closed.callback(None)

    @property
    def registered(self) -> bool:
        return any(m.WhichOneof("msg") == "ack" and m.ack.message_id == "register" and m.ack.ok
                   for m in self.received)


class AgentFactory(ClientFactory):
    def __init__(self, node_id: str, certificate_not_after: int = 0):
        self.node_id = node_id
        self.certificate_not_after = certificate_not_after
        self.protocols: list[RegisteringAgent] = []

    def buildProtocol(self, addr: Any) -> RegisteringAgent:
        p = RegisteringAgent(self.node_id, self.certificate_not_after)
        p.factory = self
        self.protocols.append(p)
        return p


def agent_tls(certs: Path | str, node_id: str, host: str = "127.0.0.1") -> AgentClientTLS:
    return AgentClientTLS(host, agent_files(certs, node_id))


def connect_in_memory(
    server_factory: Any,
    client_tls: AgentClientTLS,
    node_id: str,
    clock: IReactorTime,
    peer: str = "127.0.0.1",
    port: int = 40000,
    certificate_not_after: int = 0,
) -> tuple[RegisteringAgent, Any, iosim.IOPump]:
    """
    Connect a L{RegisteringAgent} over mutual TLS to C{server_factory} (the
    control plane's listening factory) through C{iosim}, and pump until
    quiet. Returns the agent, the server-side protocol (C{None} when the
    factory refused the connection) and the pump.
    """
    agent = AgentFactory(node_id, certificate_not_after)
    client_factory = TLSMemoryBIOFactory(client_tls, True, agent, clock=clock)
    server: list[Any] = []

    def make_server() -> Any:
        proto = server_factory.buildProtocol(IPv4Address("TCP", peer, port))
        server.append(proto)
        return proto

    client, _, pump = iosim.connectedServerAndClient(
        make_server,
        lambda: client_factory.buildProtocol(None),
        clock=clock,  # type: ignore[arg-type]
    )
    pump.flush()
    return agent.protocols[0], server[0], pump
