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
from dataclasses import replace
from pathlib import Path

from twisted.trial.unittest import SkipTest, SynchronousTestCase

from llmgw.models.errors import ChecksumMismatch, SourceNotFound
from llmgw.models.fetching import Transfer
from llmgw.models.hub import HubFetcher
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

    def test_missing(self) -> None:
        """
        A repository or file the hub lacks is L{SourceNotFound}.
        """
        with self.assertRaises(SourceNotFound):
            self.fetcher.plan(parse_source("hf://acme/none"))
        with self.assertRaises(SourceNotFound):
            self.fetcher.plan(parse_source("hf://acme/tiny", file="nothing.gguf"))
