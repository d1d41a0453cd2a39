"""
A client that pipelines requests and reads none of the answers cannot grow
a real control plane (`twistd llmgw control`, on loopback): neither through
its embedded gateway (answered locally: the model list) nor through its
admin API (twisted.web). The process's resident memory stays within a bound
while such a client floods each, and another client is still answered.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from llmgw.testing.ports import free_port, wait_bound

ROOT = Path(__file__).resolve().parent.parent
#: What the flood may add to the process's resident memory.
GROWTH_BOUND = 64 * 1024 * 1024
#: Bytes of pipelined requests each flood tries to send.
FLOOD = 20 * 1024 * 1024


def rss(pid: int) -> int:
    """
    The resident memory of process C{pid}, in bytes.
    """
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def flood(port: int, request: bytes) -> tuple[socket.socket, int]:
    """
    Pipeline C{request} to C{port} on a socket with a small receive
    buffer, reading nothing, until L{FLOOD} bytes went or the server
    stopped taking them for 3 s. Returns the socket (still open) and the
    bytes sent.
    """
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    s.settimeout(3)
    chunk = request * (65536 // len(request))
    sent = 0
    try:
        while sent < FLOOD:
            s.sendall(chunk)
            sent += len(chunk)
    except TimeoutError:
        pass
    return s, sent


class PipelinedNonReaderTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.admin, self.gateway = free_port(), free_port()
        work = Path(tempfile.mkdtemp())
        self.log = open(work / "out.txt", "wb")  # noqa: SIM115
        self.addCleanup(self.log.close)
        argv = [sys.executable, "-c", "from twisted.scripts.twistd import run; run()", "-n", "--pidfile=",
                "llmgw", "control", "--insecure", "--agent-listen", f"127.0.0.1:{free_port()}",
                "--admin", f"127.0.0.1:{self.admin}", "--gateway", f"127.0.0.1:{self.gateway}"]
        env = {"PYTHONPATH": os.pathsep.join(sys.path), "PATH": os.environ.get("PATH", "")}
        self.proc = subprocess.Popen(argv, cwd=str(work), env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self.addCleanup(self._stop)
        output = lambda: (work / "out.txt").read_text(errors="replace")  # noqa: E731
        wait_bound(self.proc, [self.admin, self.gateway], output)
        self.assertIsNone(self.proc.poll(), output())
        self.figures: dict[str, Any] = {}

    def _stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)

    def check(self, port: int, request: bytes, url: str) -> None:
        with urllib.request.urlopen(url, timeout=10) as r:
            self.assertEqual(r.status, 200)
        before = rss(self.proc.pid)
        conn, sent = flood(port, request)
        try:
            during = rss(self.proc.pid)
            with urllib.request.urlopen(url, timeout=10) as r:
                self.assertEqual(r.status, 200)
        finally:
            conn.close()
        with urllib.request.urlopen(url, timeout=10) as r:
            self.assertEqual(r.status, 200)
        after = rss(self.proc.pid)
        print(f"{url}: sent {sent} bytes; RSS before {before >> 20} MiB, during {during >> 20} MiB, "
              f"after {after >> 20} MiB")
        self.assertLess(during - before, GROWTH_BOUND, f"sent {sent} bytes")

    def test_gateway(self) -> None:
        """
        The embedded gateway: a client pipelining C{GET /v1/models} and
        reading nothing adds less than L{GROWTH_BOUND} to the process, and
        another client is answered meanwhile.
        """
        request = b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
        self.check(self.gateway, request, f"http://127.0.0.1:{self.gateway}/v1/models")

    def test_admin(self) -> None:
        """
        The admin API: the same flood of C{GET /api/v1/nodes} adds less than
        L{GROWTH_BOUND}, and another client is answered meanwhile.
        """
        host = b"127.0.0.1:%d" % self.admin
        request = b"GET /api/v1/nodes HTTP/1.1\r\nHost: " + host + b"\r\n\r\n"
        self.check(self.admin, request, f"http://127.0.0.1:{self.admin}/api/v1/nodes")
