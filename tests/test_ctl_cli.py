"""
Tests for the C{llmgw} command line itself: C{--version}, the renamed
options (C{--admin-url}, C{cert --certs}) with their old names warned, help
on every option, a quiet end on a closed pipe and on Ctrl-C, and status
values a person can read.
"""

from __future__ import annotations

import argparse
import io
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from unittest import mock

from twisted.trial.unittest import SynchronousTestCase

from llmgw.ctl.main import build_parser, main
from llmgw.ctl.render import number, render_status, seconds
from llmgw.options import renamed_warning, version_text

ROOT = Path(__file__).resolve().parent.parent
LLMGW = [sys.executable, "-c", "import sys; from llmgw.ctl.main import main; sys.exit(main())"]
ENV = {"PYTHONPATH": os.pathsep.join(sys.path), "PATH": os.environ.get("PATH", "")}


def parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """
    C{parser} and every sub-command's parser below it.
    """
    found = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found += parsers(sub)
    return found


class CommandLineTests(SynchronousTestCase):
    def run_main(self, *argv: str) -> tuple[int, str, str]:
        with mock.patch("sys.stdout", new_callable=io.StringIO) as out, \
                mock.patch("sys.stderr", new_callable=io.StringIO) as err:
            code = main(list(argv))
        return code, out.getvalue(), err.getvalue()

    def test_version(self) -> None:
        """
        `llmgw --version` prints llmgw's version and exits 0.
        """
        code, out, _ = self.run_main("--version")
        self.assertEqual((code, out), (0, version_text() + "\n"))

    def test_admin_url_and_old_name(self) -> None:
        """
        --admin-url names the admin API; --admin still does, warning once.
        """
        args = build_parser().parse_args(["ctl", "nodes", "--admin-url", "http://a:1"])
        self.assertEqual(args.admin, "http://a:1")
        with mock.patch("sys.stderr", new_callable=io.StringIO) as err:
            args = build_parser().parse_args(["ctl", "nodes", "--admin", "http://b:1"])
        self.assertEqual(args.admin, "http://b:1")
        self.assertEqual(err.getvalue().count(renamed_warning("admin", "admin-url")), 1)

    def test_cert_certs_and_old_dir(self) -> None:
        """
        `ctl cert ... --certs DIR` names the CA directory; --dir still does,
        warning once.
        """
        args = build_parser().parse_args(["ctl", "cert", "init", "--certs", "x"])
        self.assertEqual(args.dir, "x")
        with mock.patch("sys.stderr", new_callable=io.StringIO) as err:
            args = build_parser().parse_args(["ctl", "cert", "init", "--dir", "y"])
        self.assertEqual(args.dir, "y")
        self.assertIn(renamed_warning("dir", "certs"), err.getvalue())

    def test_every_option_has_help(self) -> None:
        """
        Every option and argument of every `llmgw ctl` command has a help
        text.
        """
        for parser in parsers(build_parser()):
            for action in parser._actions:
                if isinstance(action, argparse._SubParsersAction):
                    continue
                self.assertTrue(action.help, f"{parser.prog} {action.option_strings or action.dest}")


class StatusTests(SynchronousTestCase):
    def test_readable_values(self) -> None:
        """
        Status shows durations with units and times as ISO-8601 UTC with
        how long until or ago; no number in exponent notation.
        """
        text = render_status("http://x", {
            "epoch": 1700000000000, "last_pass_seconds": 8.5677e-05, "placing_after": 130.0,
            "ratio": 0.0000123,
        }, [], 100.0)
        self.assertNotIn("e-0", text)
        self.assertIn("85.7 us", text)
        self.assertIn("1970-01-01T00:02:10Z (in 30s)", text)
        self.assertIn("1700000000000 (from 2023-11-14T22:13:20Z)", text)
        self.assertEqual((number(0.0000123), seconds(2.5), seconds(0.0123)), ("0.0000123", "2.50 s", "12.3 ms"))


class ProcessTests(SynchronousTestCase):
    def test_closed_pipe_is_quiet(self) -> None:
        """
        Output into a pipe whose reader is gone (`llmgw ctl --help | head`)
        ends without a traceback, with the status a shell gives a command
        ended by SIGPIPE (141), not one of ctl's own.
        """
        read, write = os.pipe()
        p = subprocess.Popen([*LLMGW, "ctl", "cert", "--help"], stdout=write, stderr=subprocess.PIPE,
                             env=ENV, cwd=str(ROOT))
        os.close(write)
        os.close(read)
        _, err = p.communicate(timeout=120)
        self.assertNotIn(b"Traceback", err)
        self.assertNotIn(b"BrokenPipeError", err)
        self.assertEqual(p.returncode, 141, err)

    def test_watch_ctrl_c_is_quiet(self) -> None:
        """
        Ctrl-C on `llmgw ctl watch` (here while it waits on a control
        plane that accepted the connection and says nothing) ends with
        status 130 and no traceback.
        """
        listener = socket.socket()
        self.addCleanup(listener.close)
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.settimeout(120)
        port = listener.getsockname()[1]
        # SIGINT as a terminal delivers it: a test run started in the
        # background (no job control) would hand the child SIGINT ignored.
        p = subprocess.Popen([*LLMGW, "ctl", "watch", "--admin-url", f"http://127.0.0.1:{port}"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV, cwd=str(ROOT),
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        self.addCleanup(lambda: p.poll() is None and p.kill())
        conn, _ = listener.accept()
        self.addCleanup(conn.close)
        conn.settimeout(120)
        conn.recv(4096)  # its WebSocket handshake: the watch is running
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=120)
        self.assertEqual(p.returncode, 130, err)
        self.assertNotIn(b"Traceback", err)
