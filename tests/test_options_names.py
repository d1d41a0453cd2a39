"""
Tests for one name per concept across C{twistd llmgw} sub-commands: each new
name, each old name kept as a warned alias, C{--version}, help texts
without source indentation, and a usage error printed first under twistd.
"""

from __future__ import annotations

import importlib
import io
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

from twisted.python import usage
from twisted.trial.unittest import SynchronousTestCase

from llmgw import tap
from llmgw.control import service as control_service
from llmgw.gateway import service as gateway_service
from llmgw.options import renamed_warning, version_text

ROOT = Path(__file__).resolve().parent.parent


class ControlNamesTests(SynchronousTestCase):
    def parse(self, *argv: str) -> control_service.Options:
        o = control_service.Options()
        o.parseOptions(["--insecure", *argv])
        return o

    def test_new_names(self) -> None:
        """
        --agent-listen and --heartbeat set the agent port and heartbeat,
        with no warning.
        """
        o = self.parse("--agent-listen", "127.0.0.1:7000", "--heartbeat", "3")
        self.assertEqual((o["agents_host"], o["agents_port"], o["heartbeat"]), ("127.0.0.1", 7000, 3.0))
        self.assertEqual(o.warnings, [])

    def test_old_names_work_and_warn(self) -> None:
        """
        --agents and --heartbeat-interval work as the new names, each
        warning once, even when given twice.
        """
        o = self.parse("--agents", "127.0.0.1:7000", "--heartbeat-interval", "3", "--heartbeat-interval", "4")
        self.assertEqual((o["agents_port"], o["heartbeat"]), (7000, 4.0))
        self.assertEqual(o.warnings, [renamed_warning("agents", "agent-listen"),
                                      renamed_warning("heartbeat-interval", "heartbeat")])
        self.assertEqual(o.warnings[0], "--agents is now --agent-listen; --agents will be removed in the next release")

    def test_old_name_checked_as_new(self) -> None:
        """
        A bad value under an old name is refused as under the new name.
        """
        e = self.assertRaises(usage.UsageError, self.parse, "--heartbeat-interval", "0")
        self.assertIn("--heartbeat: must be a positive number", str(e))

    def test_config_old_key(self) -> None:
        """
        An old name in the --config file works and warns; the command line
        still wins over it under either name.
        """
        path = Path(self.mktemp())
        path.write_text('heartbeat-interval = 2.5\nagents = "127.0.0.1:0"\n')
        o = self.parse("--config", str(path), "--heartbeat", "7")
        self.assertEqual((o["heartbeat"], o["agents_port"]), (7.0, 0))
        self.assertIn(renamed_warning("agents", "agent-listen"), o.warnings)

    def test_warnings_logged(self) -> None:
        """
        makeService logs each warning once.
        """
        from twisted.internet.testing import MemoryReactorClock
        from twisted.logger import globalLogPublisher

        o = self.parse("--agents", "127.0.0.1:0", "--admin", "off", "--gateway", "off")
        events: list[dict[str, object]] = []
        globalLogPublisher.addObserver(events.append)
        self.addCleanup(globalLogPublisher.removeObserver, events.append)
        control_service.makeService(o, reactor=MemoryReactorClock())
        self.assertEqual([e["problem"] for e in events if "problem" in e], o.warnings)


class GatewayNamesTests(SynchronousTestCase):
    def test_new_names(self) -> None:
        """
        --gateway, --admin-url, --certs and --as are the gateway's names.
        """
        o = gateway_service.Options()
        o.parseOptions(["--gateway", "127.0.0.1:9001", "--admin-url", "http://a:1", "--certs", "d",
                        "--as", "gw", "--metrics", "off"])
        self.assertEqual((o["listen_port"], o["admin-urls"], o["certs"], o["as"]),
                         (9001, ["http://a:1"], "d", "gw"))
        self.assertEqual(o.warnings, [])

    def test_old_names_work_and_warn(self) -> None:
        """
        --listen, --control-admin (repeatable), --admin-certs and --admin-as
        work as the new names and warn once each.
        """
        o = gateway_service.Options()
        o.parseOptions(["--listen", "127.0.0.1:9001", "--control-admin", "http://a:1",
                        "--control-admin", "http://b:1", "--admin-certs", "d", "--admin-as", "gw",
                        "--metrics", "off"])
        self.assertEqual((o["listen_port"], o["admin-urls"], o["certs"], o["as"]),
                         (9001, ["http://a:1", "http://b:1"], "d", "gw"))
        self.assertEqual(o.warnings, [renamed_warning(old, new) for old, new in [
            ("listen", "gateway"), ("control-admin", "admin-url"), ("admin-certs", "certs"),
            ("admin-as", "as")]])


class LocalNamesTests(SynchronousTestCase):
    def test_agent_port_alias(self) -> None:
        """
        local's --agent-port works as --agent-listen and warns; --agents
        stays the count of agents.
        """
        from llmgw import local

        root = Path(self.mktemp())
        o = local.Options()
        o.parseOptions(["--agents", "1", "--agent-port", "127.0.0.1:0", "--certs", str(root / "c"),
                        "--state-dir", str(root / "s")])
        self.assertEqual((o["agents"], o["agent-listen"]), (1, "127.0.0.1:0"))
        self.assertEqual(o.warnings, [renamed_warning("agent-port", "agent-listen")])
        self.assertEqual(o["control"]["agents_port"], 0)


class HelpAndVersionTests(SynchronousTestCase):
    def test_help_has_no_source_indentation(self) -> None:
        """
        No help text keeps the runs of spaces of an indented docstring.
        """
        for kind in tap.KINDS:
            # The module's own Options: through tap, the gateway's would
            # install its reactor in this test process.
            options = importlib.import_module(tap.KINDS[kind][0]).Options()
            for name, doc in options.docs.items():
                self.assertNotIn("  ", doc or "", f"{kind} --{name}")

    def test_version(self) -> None:
        """
        --version on twistd llmgw and on a sub-command prints llmgw's
        version (and Twisted's) and exits 0.
        """
        import llmgw

        self.assertIn(f"llmgw {llmgw.__version__}", version_text())
        for argv in (["--version"], ["control", "--version"], ["gateway", "--version"]):
            with mock.patch("sys.stdout", new_callable=io.StringIO) as out:
                e = self.assertRaises(SystemExit, tap.Options().parseOptions, argv)
            self.assertEqual(e.code, 0)
            self.assertEqual(out.getvalue(), version_text() + "\n")


def twistd(*argv: str) -> subprocess.CompletedProcess[str]:
    """
    Run twistd with C{argv} in a child process, bounded.
    """
    return subprocess.run(
        [sys.executable, "-c", "from twisted.scripts.twistd import run; run()", *argv],
        capture_output=True, text=True, timeout=120, cwd=str(ROOT),
        env={"PYTHONPATH": os.pathsep.join(sys.path), "PATH": os.environ.get("PATH", "")},
    )


class TwistdUsageErrorTests(SynchronousTestCase):
    def test_error_first(self) -> None:
        """
        `twistd llmgw control --bogus` and a bad value print the error as
        the first line, then only a pointer to --help; exit status 1.
        """
        for argv, words in [(["--bogus"], "--bogus"), (["--heartbeat", "0"], "--heartbeat: must be")]:
            result = twistd("llmgw", "control", *argv)
            self.assertEqual(result.returncode, 1, result.stderr)
            lines = (result.stderr + result.stdout).splitlines()
            self.assertTrue(lines[0].startswith("twistd llmgw control: "), lines)
            self.assertIn(words, lines[0])
            self.assertEqual(lines[1:], ["see `twistd llmgw control --help`"])

    def test_plain_parse_still_raises(self) -> None:
        """
        Parsed outside twistd, a usage error is raised as usual.
        """
        self.assertRaises(usage.UsageError, tap.Options().parseOptions, ["control", "--bogus"])
