"""
Tests for L{llmgw.tlsconf.pem}'s writes: whatever the umask, a key is
written 0600 and a certificate 0644, whole, through a temporary file that
does not stay behind.
"""

from __future__ import annotations

import os
from pathlib import Path

from twisted.trial.unittest import SynchronousTestCase

from llmgw.tlsconf.pem import write_private, write_public


class ModeTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.dir = Path(self.mktemp())
        self.dir.mkdir()

    def under(self, umask: int) -> None:
        old = os.umask(umask)
        self.addCleanup(os.umask, old)

    def modes(self) -> dict[str, int]:
        return {p.name: p.stat().st_mode & 0o777 for p in self.dir.iterdir()}

    def test_usual_umask(self) -> None:
        """Under umask 022 the key is 0600 and the certificate 0644, and only the two files are left."""
        self.under(0o022)
        write_private(self.dir / "k.key", b"key")
        write_public(self.dir / "c.pem", b"cert")
        self.assertEqual(self.modes(), {"k.key": 0o600, "c.pem": 0o644})
        self.assertEqual((self.dir / "k.key").read_bytes(), b"key")

    def test_strict_umask(self) -> None:
        """Under umask 077 a certificate is still written 0644 (others must read it)."""
        self.under(0o077)
        write_public(self.dir / "c.pem", b"cert")
        self.assertEqual(self.modes(), {"c.pem": 0o644})

    def test_umask_that_removes_owner_bits(self) -> None:
        """Under a umask that takes the owner's write bit, the key is still 0600."""
        self.under(0o277)
        write_private(self.dir / "k.key", b"key")
        self.assertEqual(self.modes(), {"k.key": 0o600})

    def test_replaces_whole(self) -> None:
        """A second write replaces the file, with its mode."""
        self.under(0o022)
        write_private(self.dir / "k.key", b"one")
        write_private(self.dir / "k.key", b"two")
        self.assertEqual((self.dir / "k.key").read_bytes(), b"two")
        self.assertEqual(self.modes(), {"k.key": 0o600})
