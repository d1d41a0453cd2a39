"""
Tests for L{llmgw.control.core.catalogedit}: one deployment of a catalog's
text changed in place, validated as the file is.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

from twisted.trial.unittest import SynchronousTestCase

import llmgw
from llmgw.control.core.catalog import CatalogError, load_catalog, parse_catalog
from llmgw.control.core.catalogedit import (
    UneditableCatalog,
    deployment_table,
    put_deployment,
    remove_deployment,
)

DEMO = (Path(llmgw.__file__).parent / "demo-catalog.toml").read_bytes()

COMMENTED = b"""\
# The operator's own words, kept.
[profiles.p]   # a profile
command = ["{python}", "-m", "x", "--port", "{port}"]

# first
[[deployments]]
model = "a"    # model a
profile = "p"
replicas = 1

# second, with its variants
[[deployments]]
model = "b"
variants = [{profile = "p", cost = 1.0}]

[ports]
first = 21000
"""


class PutTests(SynchronousTestCase):
    def test_added_at_the_end_rest_kept(self) -> None:
        """
        A new model's deployment is appended as a [[deployments]] table;
        every byte before it is the old text.
        """
        edited = put_deployment(DEMO, "demo2", {"profile": "fake-1gpu", "replicas": 1}, "x")
        self.assertTrue(edited.text.startswith(DEMO))
        self.assertEqual(sorted(edited.catalog.deployments), ["demo", "demo2"])
        self.assertEqual(edited.catalog.deployments["demo2"].replicas, 1)
        self.assertEqual(parse_catalog(tomllib.loads(edited.text.decode())), edited.catalog)

    def test_changed_in_place_comments_kept(self) -> None:
        """
        A model's table is replaced where it stands: the comments, the other
        deployment (with its variants), the tables after it and the ports
        are kept as written.
        """
        edited = put_deployment(COMMENTED, "a", {"profile": "p", "min_replicas": 0, "max_replicas": 3}, "x")
        text = edited.text.decode()
        self.assertIn("# The operator's own words, kept.\n", text)
        self.assertIn("# first\n[[deployments]]\nmodel = \"a\"\nprofile = \"p\"\n", text)
        self.assertIn("# second, with its variants\n[[deployments]]\nmodel = \"b\"\n", text)
        self.assertIn("[ports]\nfirst = 21000\n", text)
        self.assertNotIn("model a", text)
        dep = edited.catalog.deployments["a"]
        self.assertEqual((dep.autoscale.min_replicas, dep.autoscale.max_replicas), (0, 3))  # type: ignore[union-attr]
        self.assertEqual(list(tomllib.loads(text)["deployments"][1]), ["model", "variants"])

    def test_refusal_is_the_files(self) -> None:
        """
        An entry the catalog file would refuse is refused with the message
        loading that file gives (after its path).
        """
        bad = {"profile": "fake-1gpu", "replicas": "two", "colour": None}
        for fields in (bad, {"profile": "nope"}, {"profile": "fake-1gpu", "replicas": -1},
                       {"profile": "fake-1gpu", "file": "x.gguf"}):
            with self.assertRaises(CatalogError) as caught:
                put_deployment(DEMO, "d", fields, "x")
            path = Path(self.mktemp())
            entry = "".join(f"{k} = {v!r}\n".replace("'", '"') for k, v in fields.items() if v is not None)
            path.write_bytes(DEMO + b'\n[[deployments]]\nmodel = "d"\n' + entry.encode())
            if "colour" in fields:
                path.write_bytes(path.read_bytes() + b'colour = "red"\n')
            with self.assertRaises(CatalogError) as from_file:
                load_catalog(path)
            self.assertEqual(str(from_file.exception), f"catalog {str(path)!r}: {caught.exception}")

    def test_strings_written_safely(self) -> None:
        """
        Strings with quotes, backslashes, control characters and non-ASCII
        text read back as they were sent.
        """
        args = ['--x={"a": "b\\\\c"}', "tab\there\x7f\x01", "\u00e9\U0001F600"]
        text = DEMO + b'[profiles.l]\nengine = "llamacpp"\n'
        edited = put_deployment(text, 'we"ird\\', {"profile": "l", "args": args, "source": "file:///m.gguf"}, "x")
        self.assertEqual(edited.catalog.deployments['we"ird\\'].args, tuple(args))

    def test_table_order(self) -> None:
        """
        A written table names the model, then the profile, then the rest by
        name.
        """
        self.assertEqual(deployment_table({"replicas": 2, "profile": "p", "model": "m"}),
                         '[[deployments]]\nmodel = "m"\nprofile = "p"\nreplicas = 2\n')

    def test_inline_deployments_refused(self) -> None:
        """
        A catalog whose deployments are an inline array cannot be changed
        in place: refused, saying so.
        """
        text = DEMO.split(b"[[deployments]]")[0] + b'deployments = [{model = "demo", profile = "fake-1gpu"}]\n'
        text = text.replace(b"[ports]", b'deployments = [{model = "demo", profile = "fake-1gpu"}]\n[ports]', 1)
        text = text.rsplit(b'deployments = [{model = "demo", profile = "fake-1gpu"}]\n', 1)[0]
        self.assertEqual(len(parse_catalog(tomllib.loads(text.decode())).deployments), 1)
        self.assertRaises(UneditableCatalog, put_deployment, text, "demo", {"profile": "fake-1gpu"}, "x")

    def test_header_in_a_string_refused(self) -> None:
        """
        Text that would not read back as meant (a header line inside a
        multi-line string) is refused, not stored.
        """
        text = COMMENTED.replace(b'command = ["{python}"',
                                 b'env = {A = """\n[[deployments]]\n"""}\ncommand = ["{python}"')
        self.assertRaises(UneditableCatalog, put_deployment, text, "a", {"profile": "p"}, "x")


class RemoveTests(SynchronousTestCase):
    def test_removed_with_its_comment(self) -> None:
        """
        A removed deployment's table goes with the comment right above it;
        the rest stays.
        """
        edited = remove_deployment(COMMENTED, "a", "x")
        text = edited.text.decode()
        self.assertNotIn("# first", text)
        self.assertNotIn('model = "a"', text)
        self.assertIn("# second, with its variants\n[[deployments]]\nmodel = \"b\"\n", text)
        self.assertEqual(sorted(edited.catalog.deployments), ["b"])
        self.assertNotIn("\n\n\n", text)

    def test_added_then_removed(self) -> None:
        """
        A deployment added and then removed leaves the text as it was.
        """
        for text in (DEMO, COMMENTED):
            added = put_deployment(text, "new", {"profile": "fake-1gpu" if text is DEMO else "p"}, "x")
            self.assertEqual(remove_deployment(added.text, "new", "x").text, text)

    def test_last_one(self) -> None:
        """
        Removing the only deployment leaves a valid catalog with none.
        """
        edited = remove_deployment(DEMO, "demo", "x")
        self.assertEqual(dict(edited.catalog.deployments), {})
        self.assertIn(b"[profiles.fake-1gpu]", edited.text)

    def test_unknown(self) -> None:
        """
        Removing a model the catalog does not have is a KeyError.
        """
        self.assertRaises(KeyError, remove_deployment, DEMO, "nope", "x")
