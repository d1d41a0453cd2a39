"""
Tests for L{llmgw.control.core.kept}: what an operator set, kept beside the catalog.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from unittest import mock

from twisted.trial.unittest import SynchronousTestCase

from llmgw.control.core.catalog import Deployment
from llmgw.control.core.jointokens import TokenFile
from llmgw.control.core.kept import KeptState, write_atomically
from llmgw.control.core.users import UserFile


class KeptStateTests(SynchronousTestCase):
    def test_round_trip(self) -> None:
        """
        An override is written beside the catalog and read back by a new
        state object.
        """
        catalog = self.mktemp()
        state = KeptState.beside(catalog)
        state.set("demo", 5, 2)
        again = KeptState.beside(catalog)
        self.assertEqual(again.load(), [])
        self.assertEqual(again.desired(Deployment("demo", "p", 2)), 5)

    def test_catalog_edit_wins(self) -> None:
        """
        Once the catalog's own count changes, the older override is dropped.
        """
        state = KeptState(None)
        state.set("demo", 5, 2)
        self.assertEqual(state.desired(Deployment("demo", "p", 3)), 3)

    def test_damaged_file_ignored(self) -> None:
        """
        A damaged state file is ignored with a warning, never fatal.
        """
        path = Path(self.mktemp())
        path.write_text(json.dumps({"replicas": {"demo": "x"}}))
        state = KeptState(path)
        warnings = state.load()
        self.assertEqual(len(warnings), 1)
        self.assertEqual(state.overrides, {})

    def test_nodes_round_trip(self) -> None:
        """
        Cordoned and draining nodes are written beside the catalog with the
        scale overrides and read back; a draining node is also cordoned.
        """
        catalog = self.mktemp()
        state = KeptState.beside(catalog)
        state.set("demo", 5, 2)
        self.assertTrue(state.set_nodes({"gpu-1", "gpu-2"}, {"gpu-2"}))
        self.assertFalse(state.set_nodes({"gpu-2", "gpu-1"}, ["gpu-2"]))
        again = KeptState.beside(catalog)
        self.assertEqual(again.load(), [])
        self.assertEqual((again.cordoned, again.draining), ({"gpu-1", "gpu-2"}, {"gpu-2"}))
        self.assertEqual(again.desired(Deployment("demo", "p", 2)), 5)
        self.assertEqual(sorted(p.name for p in Path(catalog).parent.iterdir() if p.name.startswith(Path(catalog).name)),
                         [Path(catalog).name + ".scale.json"])
        path = Path(catalog + ".scale.json")
        path.write_text(json.dumps({"draining": ["gpu-3"]}))
        self.assertEqual(again.load(), [])
        self.assertEqual((again.cordoned, again.draining), ({"gpu-3"}, {"gpu-3"}))

    def test_scale_only_file_loads(self) -> None:
        """
        A file from before cordons were kept, holding only C{replicas},
        loads with its overrides and nothing cordoned.
        """
        path = Path(self.mktemp())
        path.write_text(json.dumps({"replicas": {"demo": {"replicas": 4, "catalog_replicas": 1}}}))
        state = KeptState(path)
        self.assertEqual(state.load(), [])
        self.assertEqual(state.overrides, {"demo": (4, 1)})
        self.assertEqual((state.cordoned, state.draining), (frozenset(), frozenset()))

    def test_bad_node_lists_ignored(self) -> None:
        """
        A node list that is not a list of valid node ids makes the whole file
        unreadable: ignored with a warning naming the field, and moved aside.
        """
        for bad, named in [({"cordoned": "gpu-1"}, "'cordoned'"), ({"draining": [7]}, "7"),
                           ({"cordoned": ["GPU_1"]}, "GPU_1"), (["gpu-1"], "JSON object")]:
            path = Path(self.mktemp())
            path.write_text(json.dumps(bad))
            state = KeptState(path)
            [warning] = state.load()
            self.assertIn(named, warning)
            self.assertEqual((state.cordoned, state.overrides), (frozenset(), {}))
            self.assertFalse(path.exists())
            self.assertTrue(Path(str(path) + ".unreadable").exists())

    def test_failed_write_keeps_old_file(self) -> None:
        """
        A write that fails leaves the previous file whole, and a scale
        override that could not be written is not kept in memory either.
        """
        directory = Path(self.mktemp())
        directory.mkdir()
        path = directory / "c.toml.scale.json"
        state = KeptState(path)
        state.set_nodes({"gpu-1"}, ())
        before = path.read_text()
        # A directory where the temporary file goes makes the write fail.
        (directory / "c.toml.scale.json.tmp").mkdir()
        self.assertRaises(OSError, state.set, "demo", 3, 1)
        self.assertEqual(state.overrides, {})
        self.assertRaises(OSError, state.set_nodes, {"gpu-1", "gpu-2"}, ())
        self.assertEqual(path.read_text(), before)


class WriteModeTests(SynchronousTestCase):
    """A file written with a mode has it from the moment it exists, under any umask."""

    def modes_seen(self, write: object) -> list[int]:
        # The mode of each temporary file as it is renamed into place: what
        # another user could have opened before then.
        seen: list[int] = []
        real = os.replace

        def replace(src: object, dst: object) -> None:
            seen.append(os.stat(src).st_mode & 0o777)  # type: ignore[arg-type]
            real(src, dst)  # type: ignore[arg-type]

        old = os.umask(0)
        try:
            with mock.patch("llmgw.control.core.kept.os.replace", replace):
                write()  # type: ignore[operator]
        finally:
            os.umask(old)
        return seen

    def dir(self) -> Path:
        d = Path(self.mktemp())
        d.mkdir()
        return d

    def test_mode_from_creation(self) -> None:
        path = self.dir() / "f"
        self.assertEqual(self.modes_seen(lambda: write_atomically(path, "x", mode=0o600)), [0o600])
        self.assertEqual(path.stat().st_mode & 0o777, 0o600)

    def test_mode_despite_umask_taking_owner_bits(self) -> None:
        path = self.dir() / "f"
        old = os.umask(0o277)
        try:
            write_atomically(path, "x", mode=0o600)
        finally:
            os.umask(old)
        self.assertEqual(path.stat().st_mode & 0o777, 0o600)

    def test_token_and_user_files_never_readable_by_others(self) -> None:
        tokens = TokenFile(self.dir() / "join-tokens.json")
        tokens.book.create(0.0, 3600, uses=1)
        self.assertEqual(self.modes_seen(tokens.save), [0o600])
        users = UserFile(self.dir() / "users.json")
        self.assertEqual(set(self.modes_seen(users.save)), {0o600})
