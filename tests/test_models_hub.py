"""
Tests for L{llmgw.models.hub} against a real Hugging Face–compatible hub on
loopback: C{olah} in offline mode, serving a local git repository through
its C{mirrors-path} (C{MIRRORS/models/ORG/REPO}, a git repository with a
work tree, branch C{main}), with one plain file and one LFS file (a pointer
in git, its object in C{.git/lfs/objects}, as git-lfs stores it).

What olah serves from a mirror: C{list_repo_tree} and C{get_paths_info}
give each file's size and the LFS sha256 (C{model_info(files_metadata=True)}
gives neither), and C{hf_hub_download} fetches both kinds of file.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import threading
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from twisted.trial.unittest import SkipTest, SynchronousTestCase

from llmgw.models.errors import ChecksumMismatch, SourceNotFound
from llmgw.models.fetching import FileSpec, Plan, Transfer
from llmgw.models.hub import PART, HubFetcher
from llmgw.models.source import parse_source
from llmgw.testing.ports import free_port, wait_bound

WEIGHTS = os.urandom(200_000)
CONFIG = b'{"model_type": "llama"}\n'


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                   check=True, capture_output=True)


def make_mirror(root: Path, repo: str = "acme/tiny", lfs: dict[str, bytes] | None = None) -> Path:
    """
    A mirror tree for olah under C{root} holding C{repo}, with C{config.json}
    and the C{lfs} files (by default C{model.gguf}) stored as git-lfs stores
    them; returns C{root}.
    """
    work = root / "models" / repo
    work.mkdir(parents=True)
    _git(work, "init", "-q", "-b", "main")
    (work / "config.json").write_bytes(CONFIG)
    for name, data in (lfs if lfs is not None else {"model.gguf": WEIGHTS}).items():
        oid = hashlib.sha256(data).hexdigest()
        objects = work / ".git" / "lfs" / "objects" / oid[:2] / oid[2:4]
        objects.mkdir(parents=True)
        (objects / oid).write_bytes(data)
        (work / name).write_text(
            f"version https://git-lfs.github.com/spec/v1\noid sha256:{oid}\nsize {len(data)}\n")
    _git(work, "add", "-A")
    _git(work, "commit", "-qm", "tiny")
    return root


def start_olah(case: SynchronousTestCase, top: Path, mirrors: Path) -> str:
    """
    Run olah on loopback, offline, serving C{mirrors}, until C{case} ends;
    its working files go in C{top}. Returns its endpoint (for
    C{HF_ENDPOINT}).

    @raise SkipTest: olah or git is not installed.
    """
    olah = Path(sys.executable).with_name("olah-cli")
    if not olah.exists():
        raise SkipTest("olah is not installed (pip install olah: the test extra)")
    port = free_port()
    config = top / "olah.toml"
    config.write_text(
        f'[basic]\nhost = "127.0.0.1"\nport = {port}\nrepos-path = "{top / "repos"}"\n'
        f'mirrors-path = ["{mirrors}"]\n[accessibility]\noffline = true\n')
    log = (top / "olah.out").open("wb")
    case.addCleanup(log.close)
    proc = subprocess.Popen([str(olah), "-c", str(config), "--log-path", str(top / "logs")],
                            stdout=log, stderr=subprocess.STDOUT, cwd=top)

    def reap() -> None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    case.addCleanup(reap)
    if not wait_bound(proc, [port], lambda: (top / "olah.out").read_text(errors="replace"), 60):
        raise RuntimeError("olah's port was taken")
    return f"http://127.0.0.1:{port}"


class HubTests(SynchronousTestCase):
    def setUp(self) -> None:
        if shutil.which("git") is None:
            raise SkipTest("git is not installed")
        top = Path(self.mktemp()).absolute()
        endpoint = start_olah(self, top, make_mirror(top / "mirrors"))
        self.fetcher = HubFetcher(endpoint=endpoint, token=False)
        self.dir = Path(self.mktemp())

    def test_plan(self) -> None:
        """
        The plan lists the repository's files at main's commit, with sizes,
        the LFS file's sha256 and the plain file's git blob id.
        """
        plan = self.fetcher.plan(parse_source("hf://acme/tiny"))
        self.assertEqual(len(plan.revision), 40)
        files = {f.path: f for f in plan.files}
        self.assertEqual(set(files), {"config.json", "model.gguf"})
        self.assertEqual((files["model.gguf"].size, files["model.gguf"].sha256),
                         (len(WEIGHTS), hashlib.sha256(WEIGHTS).hexdigest()))
        blob = hashlib.sha1(b"blob %d\0" % len(CONFIG) + CONFIG, usedforsecurity=False).hexdigest()
        self.assertEqual((files["config.json"].size, files["config.json"].git_sha1), (len(CONFIG), blob))
        self.assertEqual(plan.total, len(WEIGHTS) + len(CONFIG))

    def test_fetch_snapshot(self) -> None:
        """
        The snapshot's files are fetched and checked; a damaged file is
        fetched again on the next fetch, and the whole file counted.
        """
        source = parse_source("hf://acme/tiny")
        plan = self.fetcher.plan(source)
        transfer = Transfer()
        self.fetcher.fetch(source, plan, self.dir, transfer)
        self.assertEqual((self.dir / "model.gguf").read_bytes(), WEIGHTS)
        self.assertEqual((self.dir / "config.json").read_bytes(), CONFIG)
        self.assertGreaterEqual(transfer.done, len(WEIGHTS))
        (self.dir / "model.gguf").write_bytes(b"x" * len(WEIGHTS))
        self.fetcher.fetch(source, plan, self.dir, Transfer())
        self.assertEqual((self.dir / "model.gguf").read_bytes(), WEIGHTS)

    def test_one_file(self) -> None:
        """
        With C{file}, only that file is planned and fetched, and it is the target.
        """
        source = parse_source("hf://acme/tiny", file="model.gguf")
        plan = self.fetcher.plan(source)
        self.assertEqual(([f.path for f in plan.files], plan.target), (["model.gguf"], "model.gguf"))
        self.fetcher.fetch(source, plan, self.dir, Transfer())
        self.assertFalse((self.dir / "config.json").exists())

    def test_wrong_bytes_refused(self) -> None:
        """
        Bytes that do not match the hub's sha256 are refused (here the plan
        says another sha256 than the one the hub serves bytes for).
        """
        source = parse_source("hf://acme/tiny", file="model.gguf")
        plan = self.fetcher.plan(source)
        bad = replace(plan, files=(replace(plan.files[0], sha256="0" * 64),))
        with self.assertRaises(ChecksumMismatch):
            self.fetcher.fetch(source, bad, self.dir, Transfer())
        self.assertFalse((self.dir / "model.gguf").exists())
        self.assertFalse((self.dir / ("model.gguf" + PART)).exists())

    def test_wrong_git_blob_refused(self) -> None:
        """
        A plain (non-LFS) file is checked against its git blob id while it
        streams: another id in the plan refuses the bytes, and nothing is left.
        """
        source = parse_source("hf://acme/tiny", file="config.json")
        plan = self.fetcher.plan(source)
        bad = replace(plan, files=(replace(plan.files[0], git_sha1="0" * 40),))
        with self.assertRaises(ChecksumMismatch):
            self.fetcher.fetch(source, bad, self.dir, Transfer())
        self.assertEqual(list(self.dir.iterdir()), [])

    def test_range_ignored_starts_over(self) -> None:
        """
        A server that ignores the Range (olah serving a mirror answers 200)
        has the part thrown away and the file fetched whole, counted once.
        """
        source = parse_source("hf://acme/tiny", file="model.gguf")
        plan = self.fetcher.plan(source)
        self.dir.mkdir()
        (self.dir / ("model.gguf" + PART)).write_bytes(b"\0" * 100_000)
        transfer = Transfer()
        self.fetcher.fetch(source, plan, self.dir, transfer)
        self.assertEqual((self.dir / "model.gguf").read_bytes(), WEIGHTS)
        self.assertEqual(transfer.done, len(WEIGHTS))
        self.assertFalse((self.dir / ("model.gguf" + PART)).exists())

    def test_oversized_part_restarts(self) -> None:
        """
        A part longer than the hub's file is thrown away and the file
        fetched whole.
        """
        source = parse_source("hf://acme/tiny", file="model.gguf")
        plan = self.fetcher.plan(source)
        self.dir.mkdir()
        (self.dir / ("model.gguf" + PART)).write_bytes(WEIGHTS + b"extra")
        transfer = Transfer()
        self.fetcher.fetch(source, plan, self.dir, transfer)
        self.assertEqual((self.dir / "model.gguf").read_bytes(), WEIGHTS)
        self.assertEqual(transfer.done, len(WEIGHTS))

    def test_missing(self) -> None:
        """
        A repository or file the hub lacks is L{SourceNotFound}.
        """
        with self.assertRaises(SourceNotFound):
            self.fetcher.plan(parse_source("hf://acme/none"))
        with self.assertRaises(SourceNotFound):
            self.fetcher.plan(parse_source("hf://acme/tiny", file="nothing.gguf"))


class _RangeHub(BaseHTTPRequestHandler):
    """
    Serves C{WEIGHTS} at a hub's resolve URL for C{acme/tiny}'s
    C{model.gguf}, honouring a C{Range: bytes=N-} as the hub's CDN does,
    and records the Range headers it was sent.
    """

    ranges: list[str | None] = []

    def do_GET(self) -> None:
        if not self.path.startswith("/acme/tiny/resolve/") or not self.path.endswith("/model.gguf"):
            self.send_error(404)
            return
        wanted = self.headers.get("Range")
        self.ranges.append(wanted)
        start = int(wanted.removeprefix("bytes=").rstrip("-")) if wanted else 0
        self.send_response(206 if wanted else 200)
        self.send_header("Content-Length", str(len(WEIGHTS) - start))
        self.end_headers()
        self.wfile.write(WEIGHTS[start:])

    def log_message(self, format: str, *args: object) -> None:
        pass


class ResumeTests(SynchronousTestCase):
    """
    Resuming from a part against a server that honours Range (a small
    HTTP server on loopback in a thread, standing in for the hub's CDN).
    """

    def setUp(self) -> None:
        _RangeHub.ranges = []
        httpd = ThreadingHTTPServer(("127.0.0.1", 0), _RangeHub)
        thread = threading.Thread(target=httpd.serve_forever, daemon=True)
        thread.start()

        def stop() -> None:
            httpd.shutdown()
            httpd.server_close()
            thread.join()
        self.addCleanup(stop)
        self.fetcher = HubFetcher(endpoint=f"http://127.0.0.1:{httpd.server_address[1]}", token=False)
        self.source = parse_source("hf://acme/tiny", file="model.gguf")
        self.plan = Plan(files=(FileSpec("model.gguf", len(WEIGHTS), hashlib.sha256(WEIGHTS).hexdigest()),),
                         revision="a" * 40, target="model.gguf")
        self.dir = Path(self.mktemp())
        self.dir.mkdir()

    def test_resume_from_part(self) -> None:
        """
        A part an earlier fetch left is resumed from where it ends (only the
        rest is asked for), the whole file is counted once, and the part
        takes the file's name.
        """
        (self.dir / ("model.gguf" + PART)).write_bytes(WEIGHTS[:70_001])
        transfer = Transfer()
        self.fetcher.fetch(self.source, self.plan, self.dir, transfer)
        self.assertEqual(_RangeHub.ranges, ["bytes=70001-"])
        self.assertEqual((self.dir / "model.gguf").read_bytes(), WEIGHTS)
        self.assertEqual(transfer.done, len(WEIGHTS))
        self.assertFalse((self.dir / ("model.gguf" + PART)).exists())

    def test_resumed_part_is_checked(self) -> None:
        """
        The bytes of a resumed part count in the checksum: a part whose
        bytes differ from the source's makes the whole file fail its check,
        and it is deleted, so that the next fetch starts over and succeeds.
        """
        (self.dir / ("model.gguf" + PART)).write_bytes(b"\0" * 100_000)
        with self.assertRaises(ChecksumMismatch):
            self.fetcher.fetch(self.source, self.plan, self.dir, Transfer())
        self.assertEqual(list(self.dir.iterdir()), [])
        self.fetcher.fetch(self.source, self.plan, self.dir, Transfer())
        self.assertEqual(_RangeHub.ranges, ["bytes=100000-", None])
        self.assertEqual((self.dir / "model.gguf").read_bytes(), WEIGHTS)

    def test_whole_part_not_fetched(self) -> None:
        """
        A part already whole is checked and named without a request.
        """
        (self.dir / ("model.gguf" + PART)).write_bytes(WEIGHTS)
        self.fetcher.fetch(self.source, self.plan, self.dir, Transfer())
        self.assertEqual(_RangeHub.ranges, [])
        self.assertEqual((self.dir / "model.gguf").read_bytes(), WEIGHTS)
