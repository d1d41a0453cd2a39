"""
A listening address already taken at start is refused in one line that
names the address and the option that changes it, for every listener of
the control plane, the standalone gateway and the local fleet (real
sockets on loopback, one taken by the test); and twistd ends with that
line, not a traceback.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path
from typing import Any

from twisted.internet import reactor
from twisted.internet.defer import Deferred, inlineCallbacks
from twisted.internet.protocol import ProcessProtocol
from twisted.trial.unittest import TestCase

from llmgw import local
from llmgw.addresses import ListenRefused
from llmgw.control import service as control_service
from llmgw.gateway import service as gateway_service


def taken_port(testcase: TestCase) -> int:
    """
    A loopback port the test holds bound and listening until it ends.
    """
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    testcase.addCleanup(s.close)
    return int(s.getsockname()[1])


class RefusalTests(TestCase):
    timeout = 60

    def assertRefused(self, service: Any, port: int, option: str, what: str) -> None:
        self.addCleanup(service.stopService)
        e = self.assertRaises(ListenRefused, service.startService)
        message = str(e)
        self.assertNotIn("\n", message)
        self.assertIn(f"127.0.0.1:{port}", message)
        self.assertIn(f"choose another with {option} ", message)
        self.assertIn(what, message)
        self.assertIn("in use", message)
        self.assertEqual(e.code, message)  # SystemExit: twistd prints it and exits 1

    def control(self, **addresses: str) -> Any:
        argv = ["--insecure", "--agent-listen", "127.0.0.1:0", "--admin", "127.0.0.1:0", "--gateway", "127.0.0.1:0"]
        for name, value in addresses.items():
            argv += [f"--{name}", value]
        o = control_service.Options()
        o.parseOptions(argv)
        return control_service.makeService(o, reactor=reactor)

    def test_control_agent_port(self) -> None:
        """
        The control plane's agent port names --agent-listen.
        """
        port = taken_port(self)
        self.assertRefused(self.control(agents=f"127.0.0.1:{port}"), port, "--agent-listen", "the agent stream")

    def test_control_admin(self) -> None:
        """
        The admin API names --admin.
        """
        port = taken_port(self)
        self.assertRefused(self.control(admin=f"127.0.0.1:{port}"), port, "--admin", "the admin API")

    def test_control_gateway(self) -> None:
        """
        The embedded gateway names --gateway.
        """
        port = taken_port(self)
        self.assertRefused(self.control(gateway=f"127.0.0.1:{port}"), port, "--gateway", "the gateway")

    def gateway(self, *argv: str) -> Any:
        o = gateway_service.Options()
        o.parseOptions(["--gateway", "127.0.0.1:0", "--metrics", "127.0.0.1:0", *argv])
        return gateway_service.makeService(o, reactor=reactor)

    def test_gateway_listen(self) -> None:
        """
        The standalone gateway's front names --gateway.
        """
        port = taken_port(self)
        self.assertRefused(self.gateway("--gateway", f"127.0.0.1:{port}"), port, "--gateway", "the gateway")

    def test_gateway_metrics(self) -> None:
        """
        The standalone gateway's /metrics names --metrics.
        """
        port = taken_port(self)
        self.assertRefused(self.gateway("--metrics", f"127.0.0.1:{port}"), port, "--metrics", "/metrics")

    def fleet(self, *argv: str) -> Any:
        root = Path(self.mktemp())
        o = local.Options()
        o.parseOptions([
            "--agents", "1", "--certs", str(root / "certs"), "--state-dir", str(root / "state"),
            "--gateway", "127.0.0.1:0", "--admin", "127.0.0.1:0", *argv,
        ])
        return local.makeService(o, reactor=reactor)

    def test_local_listeners(self) -> None:
        """
        Each listener of the local fleet names the local fleet's own option:
        --agent-listen, --admin, --gateway.
        """
        for option, what in (("--agent-listen", "the agent stream"), ("--admin", "the admin API"),
                             ("--gateway", "the gateway")):
            port = taken_port(self)
            self.assertRefused(self.fleet(option, f"127.0.0.1:{port}"), port, option, what)


class _Collect(ProcessProtocol):
    def __init__(self) -> None:
        self.out = b""
        self.ended: Deferred[int] = Deferred()

    def outReceived(self, data: bytes) -> None:
        self.out += data

    errReceived = outReceived

    def processEnded(self, reason: Any) -> None:
        self.ended.callback(reason.value.exitCode)


class TwistdTests(TestCase):
    timeout = 60

    @inlineCallbacks
    def test_twistd_one_line(self) -> Any:
        """
        C{twistd -n llmgw gateway} on a taken port exits with status 1 and
        the refusal as its last line, with no traceback.
        """
        port = taken_port(self)
        p = _Collect()
        twistd = [sys.executable, "-c", "from twisted.scripts.twistd import run; run()"]
        reactor.spawnProcess(
            p, sys.executable,
            [*twistd, "-n", "--pidfile=", "llmgw", "gateway", "--gateway", f"127.0.0.1:{port}",
             "--metrics", "off"],
            env={"PYTHONPATH": os.pathsep.join(sys.path), "PATH": os.environ.get("PATH", "")},
            path=str(Path(__file__).resolve().parent.parent),
        )
        code = yield p.ended
        text = p.out.decode("utf-8", "replace")
        self.assertEqual(code, 1, text)
        self.assertNotIn("Traceback", text)
        last = text.strip().splitlines()[-1]
        self.assertIn(f"cannot listen on 127.0.0.1:{port} for the gateway", last)
        self.assertIn("--gateway", last)
