"""
API keys files and the check of C{Authorization} headers.
"""

from __future__ import annotations

import os
from pathlib import Path

from twisted.trial.unittest import SynchronousTestCase

from llmgw.gateway.keys import KeyRing, KeysError, load_keys, parse_keys
from llmgw.gateway.usage import KeyLimits


class KeyRingTests(SynchronousTestCase):
    def test_authenticate(self) -> None:
        """
        A Bearer header with a listed key gives that key's name; anything
        else gives C{None}.
        """
        ring = KeyRing({"alice": "sk-alice-0001", "bob": "sk-bob-00002"})
        self.assertEqual(ring.authenticate(b"Bearer sk-alice-0001"), "alice")
        self.assertEqual(ring.authenticate(b"bearer  sk-bob-00002 "), "bob")
        for bad in (None, b"", b"Bearer", b"Bearer ", b"Basic sk-alice-0001", b"Bearer sk-alice-000", b"sk-alice-0001"):
            self.assertIsNone(ring.authenticate(bad), bad)

    def test_duplicate_refused(self) -> None:
        """
        The same key under two names is refused, naming both names.
        """
        e = self.assertRaises(KeysError, KeyRing, {"a": "sk-same-key", "b": "sk-same-key"})
        self.assertIn("'a'", str(e))
        self.assertNotIn("sk-same-key", str(e))


class ParseTests(SynchronousTestCase):
    def test_lines(self) -> None:
        """
        One key per line; blank lines and comments are skipped; keys are
        named by line number.
        """
        ring = parse_keys("# team keys\n\nsk-first-key\n  sk-second-key  \n", toml=False)
        self.assertEqual(ring.names(), ["line 3", "line 4"])
        self.assertEqual(ring.authenticate(b"Bearer sk-second-key"), "line 4")

    def test_toml(self) -> None:
        """
        A TOML file names its keys, in a C{[keys]} table or at top level.
        """
        ring = parse_keys('[keys]\nalice = "sk-alice-0001"\n', toml=True)
        self.assertEqual(ring.authenticate(b"Bearer sk-alice-0001"), "alice")
        ring = parse_keys('bob = "sk-bob-00002"\n', toml=True)
        self.assertEqual(ring.names(), ["bob"])

    def test_bad_files(self) -> None:
        """
        Empty files, short keys, keys with spaces, non-string TOML values
        and broken TOML are refused with a message that never holds a key.
        """
        cases = [
            ("", False, "no key"),
            ("# only a comment\n", False, "no key"),
            ("short\n", False, "shorter"),
            ('[keys]\na = "sk with space"\n', True, "white space"),
            ("[keys]\na = 5\n", True, "must be a string"),
            ("[keys\n", True, "not valid TOML"),
        ]
        for text, toml, message in cases:
            e = self.assertRaises(KeysError, parse_keys, text, toml)
            self.assertIn(message, str(e))
        e = self.assertRaises(KeysError, parse_keys, "sk-shared-one\nsk-shared-one\n", False)
        self.assertNotIn("sk-shared-one", str(e))

    def test_load(self) -> None:
        """
        L{load_keys} reads a file (TOML by its suffix); a missing file is a
        clear error.
        """
        d = Path(self.mktemp())
        d.mkdir()
        p = d / "keys.toml"
        p.write_text('[keys]\nalice = "sk-alice-0001"\n')
        os.chmod(p, 0o600)
        self.assertEqual(load_keys(p).names(), ["alice"])
        e = self.assertRaises(KeysError, load_keys, d / "missing")
        self.assertIn("missing", str(e))


class LimitsFormTests(SynchronousTestCase):
    def test_table_form_with_limits(self) -> None:
        """
        A C{[keys.NAME]} table gives a key with its limits (either may be
        left out), beside keys in the plain C{name = "key"} form in the
        same C{[keys]} table; keys without limits have none.
        """
        ring = parse_keys(
            '[keys]\nalice = "sk-alice-0001"\n\n'
            '[keys.team-a]\nkey = "sk-team-a-0001"\nrequests_per_minute = 60\ntokens_per_minute = 100000\n\n'
            '[keys.batch]\nkey = "sk-batch-00002"\ntokens_per_minute = 5000\n\n'
            '[keys.plain]\nkey = "sk-plain-00003"\n',
            toml=True,
        )
        self.assertEqual(ring.names(), ["alice", "batch", "plain", "team-a"])
        self.assertEqual(ring.authenticate(b"Bearer sk-team-a-0001"), "team-a")
        self.assertEqual(ring.authenticate(b"Bearer sk-alice-0001"), "alice")
        self.assertEqual(ring.limits, {
            "team-a": KeyLimits(requests_per_minute=60, tokens_per_minute=100000),
            "batch": KeyLimits(tokens_per_minute=5000),
        })

    def test_bad_entries_name_the_key(self) -> None:
        """
        A bad entry in a key's table is refused with a message that names
        the key and the field, and never holds the secret.
        """
        secret = "sk-secret-0001"
        cases = [
            (f'[keys.team-a]\nkey = "{secret}"\nrequests_per_minute = 0\n', "requests_per_minute must be a positive"),
            (f'[keys.team-a]\nkey = "{secret}"\nrequests_per_minute = -5\n', "positive whole number"),
            (f'[keys.team-a]\nkey = "{secret}"\ntokens_per_minute = 1.5\n', "tokens_per_minute must be"),
            (f'[keys.team-a]\nkey = "{secret}"\ntokens_per_minute = "lots"\n', "tokens_per_minute must be"),
            (f'[keys.team-a]\nkey = "{secret}"\nrequests_per_minute = true\n', "requests_per_minute must be"),
            (f'[keys.team-a]\nkey = "{secret}"\nrequests_per_hour = 5\n', "unknown field(s) 'requests_per_hour'"),
            ('[keys.team-a]\nrequests_per_minute = 5\n', 'needs key = "..."'),
            ('[keys.team-a]\nkey = 12345678\n', 'needs key = "..."'),
            ('[keys.team-a]\nkey = "short"\n', "shorter than"),
            ("[keys]\nteam-a = [1, 2]\n", "must be a string, or a table [keys.team-a]"),
        ]
        for text, message in cases:
            e = self.assertRaises(KeysError, parse_keys, text, True, "keys.toml")
            self.assertIn(message, str(e), text)
            self.assertIn("'team-a'", str(e), text)
            self.assertIn("keys.toml", str(e), text)
            self.assertNotIn(secret, str(e), text)
