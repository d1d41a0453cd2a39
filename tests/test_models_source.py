"""
Tests for L{llmgw.models.source}: parsing a model's source and its cache key.
"""

from __future__ import annotations

from twisted.trial.unittest import SynchronousTestCase

from llmgw.models.errors import SourceInvalid
from llmgw.models.source import (
    HttpsSource,
    HubSource,
    LocalSource,
    cache_key,
    from_spec,
    parse_source,
)
from llmgw.sourcespec import ModelSource
from llmgw.sourcespec import parse_source as parse_spec

SHA = "ab" * 32


class ParseTests(SynchronousTestCase):
    def test_hub(self) -> None:
        """
        hf://ORG/REPO means its main branch; @REVISION and file are kept.
        """
        self.assertEqual(parse_source("hf://acme/tiny"), HubSource("acme/tiny", "main"))
        self.assertEqual(parse_source("hf://acme/tiny@v1.0", file="m.gguf"),
                         HubSource("acme/tiny", "v1.0", "m.gguf"))
        self.assertEqual(parse_source("hf://acme/tiny@refs/pr/1").revision, "refs/pr/1")

    def test_https(self) -> None:
        """
        An https source keeps its URL and its sha256, lower-cased.
        """
        source = parse_source("https://example.com/m/tiny.gguf?x=1", sha256=SHA.upper())
        self.assertEqual(source, HttpsSource("https://example.com/m/tiny.gguf?x=1", SHA))
        assert isinstance(source, HttpsSource)
        self.assertEqual(source.filename, "tiny.gguf")

    def test_local(self) -> None:
        """
        A file source is an absolute path.
        """
        self.assertEqual(parse_source("file:///models/tiny.gguf"), LocalSource("/models/tiny.gguf"))

    def test_refused(self) -> None:
        """
        Each malformed source is refused with an error naming what was wrong.
        """
        cases = {
            ("tiny",): "is not a source",
            ("s3://b/k",): "unknown scheme",
            ("http://example.com/m.gguf",): "plain http",
            ("hf://tiny",): "ORG/REPO",
            ("hf://a/b/c",): "ORG/REPO",
            ("hf://acme/-bad",): "ORG/REPO",
            ("hf://acme/tiny@",): "is not a branch, tag or commit",
            ("hf://acme/tiny@a..b",): "revision",
            ("https://example.com/m.gguf",): "needs a 'sha256'",
            ("https://example.com/",): "names no file",
            ("https://u:p@example.com/m.gguf",): "credentials",
            ("file://relative/path",): "no host",
            ("file:///a/../b",): "'..'",
        }
        for (text,), words in cases.items():
            with self.assertRaises(SourceInvalid, msg=text) as caught:
                parse_source(text)
            self.assertIn(words, str(caught.exception), text)
        for kwargs, words in [
            ({"file": "../x"}, "file '../x' must be a relative path"),
            ({"file": "/x"}, "relative path"),
            ({"sha256": SHA}, "sha256 applies to https:// sources only"),
            ({"file": "a", "allow": ["*.json"]}, "either file or allow"),
        ]:
            with self.assertRaises(SourceInvalid) as caught:
                parse_source("hf://acme/tiny", **kwargs)  # type: ignore[arg-type]
            self.assertIn(words, str(caught.exception))
        with self.assertRaises(SourceInvalid) as caught:
            parse_source("https://example.com/m.gguf", sha256="abc")
        self.assertIn("64 hex", str(caught.exception))
        with self.assertRaises(SourceInvalid):
            parse_source("file:///m.gguf", file="x")

    def test_from_spec(self) -> None:
        """
        The catalog's parsed source converts to the cache's form: a hub
        source without a revision means main, and a malformed one from
        the wire is refused as a configuration failure.
        """
        self.assertEqual(from_spec(parse_spec("hf://acme/tiny", file="m.gguf")),
                         HubSource("acme/tiny", "main", "m.gguf"))
        self.assertEqual(from_spec(parse_spec("https://e.com/a.gguf", sha256=SHA)),
                         HttpsSource("https://e.com/a.gguf", SHA))
        self.assertEqual(from_spec(parse_spec("file:///m/x.gguf")), LocalSource("/m/x.gguf"))
        with self.assertRaises(SourceInvalid) as caught:
            from_spec(ModelSource(scheme="hf", repo="../x"))
        self.assertIn("ORG/REPO", str(caught.exception))

    def test_failure_class(self) -> None:
        """
        A bad source is a configuration failure.
        """
        self.assertEqual(SourceInvalid.failure_class, "config")


class KeyTests(SynchronousTestCase):
    def test_stable_and_distinct(self) -> None:
        """
        The key is the same for the same source, differs for another
        revision, file or checksum, and is one safe directory name.
        """
        base = cache_key(parse_source("hf://acme/tiny"))
        self.assertEqual(base, cache_key(parse_source("hf://acme/tiny@main")))
        others = {
            cache_key(parse_source("hf://acme/tiny@v2")),
            cache_key(parse_source("hf://acme/tiny", file="a.gguf")),
            cache_key(parse_source("https://e.com/a.gguf", sha256=SHA)),
            cache_key(parse_source("https://e.com/a.gguf", sha256="cd" * 32)),
        }
        self.assertEqual(len(others | {base}), 5)
        for key in others | {base}:
            self.assertNotIn("/", key)
        self.assertTrue(base.startswith("hf-acme--tiny--main-"))
        # Pinned: a key that changed between versions would orphan every cache.
        self.assertEqual(base, "hf-acme--tiny--main-7e54b253432f97b2")
