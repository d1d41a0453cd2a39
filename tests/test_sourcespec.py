"""
Tests for L{llmgw.sourcespec}: a deployment's model source, from the
catalog's text.
"""

from __future__ import annotations

from twisted.trial.unittest import SynchronousTestCase

from llmgw.sourcespec import ModelSource, SourceError, parse_source

SHA = "ab" * 32


class ParseSourceTests(SynchronousTestCase):
    def refused(self, text: str, file: str = "", sha256: str = "") -> SourceError:
        with self.assertRaises(SourceError) as ctx:
            parse_source(text, file=file, sha256=sha256)
        return ctx.exception

    def test_hf(self) -> None:
        """
        hf://ORG/REPO names a whole repository at its default revision;
        @REVISION a branch, tag, commit or pull-request ref; file one file
        of it.
        """
        self.assertEqual(parse_source("hf://Qwen/Qwen2.5-0.5B-Instruct"),
                         ModelSource(scheme="hf", repo="Qwen/Qwen2.5-0.5B-Instruct"))
        self.assertEqual(parse_source("hf://org/repo@refs/pr/1"),
                         ModelSource(scheme="hf", repo="org/repo", revision="refs/pr/1"))
        got = parse_source("hf://org/repo-GGUF@v1.0", file="sub/model-q4_k_m.gguf")
        self.assertEqual((got.revision, got.file, got.single_file), ("v1.0", "sub/model-q4_k_m.gguf", True))
        self.assertFalse(parse_source("hf://org/repo").single_file)

    def test_hf_refused(self) -> None:
        """
        A repository that is not ORG/REPO, a revision with characters no git
        ref has, and a file that climbs out of the repository are refused,
        each naming the field at fault.
        """
        for text in ("hf://repo", "hf://a/b/c", "hf://-a/b", "hf://a/b..c", "hf://a/b c", "hf://a/"):
            self.assertEqual(self.refused(text).field, "source", text)
            self.assertIn("ORG/REPO", str(self.refused(text)))
        for rev in ("", "a b", "-x", "a..b", "/x", "x/", "a@b", "a:b"):
            err = self.refused(f"hf://a/b@{rev}")
            self.assertIn("is not a branch, tag or commit", str(err), rev)
        for name in ("/etc/passwd", "../x.gguf", "a//b.gguf", "a/./b", "a\\b"):
            err = self.refused("hf://a/b", file=name)
            self.assertEqual(err.field, "file", name)

    def test_https(self) -> None:
        """
        An https source is one file with its sha256 beside it, kept in
        lowercase.
        """
        got = parse_source("https://example.com/m/tiny.gguf?x=1", sha256=SHA.upper())
        self.assertEqual(got, ModelSource(scheme="https", url="https://example.com/m/tiny.gguf?x=1",
                                          sha256=SHA))
        self.assertTrue(got.single_file)

    def test_https_refused(self) -> None:
        """
        No sha256, a sha256 that is not 64 hex digits, no host, no file, and
        credentials in the URL are refused; the checksum's faults name the
        sha256 field.
        """
        self.assertEqual(self.refused("https://h/x.gguf").field, "sha256")
        self.assertIn("64 hex digits", str(self.refused("https://h/x.gguf", sha256="abc")))
        self.assertIn("names no host", str(self.refused("https:///x.gguf", sha256=SHA)))
        self.assertIn("names no file", str(self.refused("https://h/", sha256=SHA)))
        err = self.refused("https://user:secret@h/x.gguf", sha256=SHA)
        self.assertIn("credentials", str(err))
        self.assertNotIn("secret", str(err))

    def test_file(self) -> None:
        """
        file:///PATH names an absolute path on the node, percent-decoded.
        """
        self.assertEqual(parse_source("file:///srv/models/a%20b.gguf"),
                         ModelSource(scheme="file", path="/srv/models/a b.gguf"))
        for text in ("file://host/x", "file://relative", "file:///a/../b"):
            self.assertEqual(self.refused(text).field, "source", text)

    def test_scheme_and_misplaced_fields(self) -> None:
        """
        An unknown scheme names the known ones; file on a source other than
        hf, and sha256 on one other than https, are refused on their field.
        """
        err = self.refused("s3://bucket/x")
        self.assertIn("unknown scheme 's3'", str(err))
        self.assertIn("hf://, https://, file://", str(err))
        self.assertIn("is not a source", str(self.refused("org/repo")))
        self.assertEqual(self.refused("file:///x", file="y.gguf").field, "file")
        self.assertEqual(self.refused("https://h/x", file="y.gguf", sha256=SHA).field, "file")
        self.assertEqual(self.refused("hf://a/b", sha256=SHA).field, "sha256")

    def test_uri_and_problem(self) -> None:
        """
        A source's uri parses back to it; a source that did not come from
        parse_source (off the wire) says what is wrong with it.
        """
        for source in (parse_source("hf://a/b@main", file="x.gguf"),
                       parse_source("https://h/x", sha256=SHA),
                       parse_source("file:///a%20b/c")):
            self.assertEqual(parse_source(source.uri, file=source.file, sha256=source.sha256), source)
            self.assertIsNone(source.problem())
        self.assertIn("unknown scheme", ModelSource(scheme="ftp").problem() or "")
        self.assertIn("ORG/REPO", ModelSource(scheme="hf", repo="../x").problem() or "")
        self.assertIn("canonical", ModelSource(scheme="file", path="/x", repo="a/b").problem() or "")
