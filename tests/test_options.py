"""
Tests for L{llmgw.options}: coercion in C{usage.Options}, errors that name
the option, the same for values from the control plane's C{--config} file.
"""

from __future__ import annotations

from pathlib import Path

from twisted.python import usage
from twisted.trial.unittest import SynchronousTestCase

from llmgw.control import service as control_service
from llmgw.options import Options, non_negative_int, positive_float


class Example(Options):
    optParameters = [
        ["interval", None, 2.0, "seconds", positive_float],
        ["count", None, 0, "how many", non_negative_int],
        ["name", None, "x", "a string"],
    ]


class OptionsTests(SynchronousTestCase):
    def test_coerced(self) -> None:
        """
        Given values are coerced; defaults are already typed.
        """
        o = Example()
        o.parseOptions(["--interval", "0.5"])
        self.assertEqual((o["interval"], o["count"], o["name"]), (0.5, 0, "x"))
        o = Example()
        o.parseOptions(["--count", "3"])
        self.assertEqual(o["count"], 3)

    def test_errors_name_option(self) -> None:
        """
        A refused value's error names the option and says what was wrong.
        """
        for argv, words in [
            (["--interval", "soon"], ["--interval", "'soon' is not a number"]),
            (["--interval", "0"], ["--interval", "must be a positive number"]),
            (["--interval", "nan"], ["--interval", "not a finite number"]),
            (["--count", "1.5"], ["--count", "not a whole number"]),
            (["--count", "-1"], ["--count", "must be a whole number, 0 or more"]),
        ]:
            e = self.assertRaises(usage.UsageError, Example().parseOptions, argv)
            for w in words:
                self.assertIn(w, str(e))

    def test_help_says_type(self) -> None:
        """
        The help text states each typed option's kind of value.
        """
        self.assertIn("A positive number.", str(Example()))

    def test_control_config_file_coerced(self) -> None:
        """
        Values from the control plane's --config file go through the same
        coercion, refused with the file and the option named.
        """
        path = Path(self.mktemp())
        path.write_text('insecure = true\nagent-listen = "127.0.0.1:0"\nmax-frame = 1024\nheartbeat = 2.5\n')
        o = control_service.Options()
        o.parseOptions(["--config", str(path)])
        self.assertEqual((o["max-frame"], o["heartbeat"]), (1024, 2.5))
        path.write_text("insecure = true\nbacklog = 0\n")
        e = self.assertRaises(usage.UsageError, control_service.Options().parseOptions, ["--config", str(path)])
        self.assertIn(str(path), str(e))
        self.assertIn("--backlog: must be a positive whole number", str(e))

    def test_control_numbers_typed(self) -> None:
        """
        The control plane's numbers and limits are numbers after parsing,
        given or not.
        """
        o = control_service.Options()
        o.parseOptions(["--insecure", "--agent-message-rate", "2.5", "--max-connections", "10"])
        self.assertEqual(o["limits"].message_rate, 2.5)
        self.assertEqual(o["limits"].max_connections, 10)
        self.assertIsInstance(o["pass-interval"], float)
        self.assertIsInstance(o["backlog"], int)
