"""
Tests for L{llmgw.control.core.kept}: what an operator set, kept beside the catalog.
"""

from __future__ import annotations

import json
from pathlib import Path

from twisted.trial.unittest import SynchronousTestCase

from llmgw.control.core.catalog import Deployment
from llmgw.control.core.kept import KeptState


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
