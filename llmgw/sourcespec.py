"""
Where a model's weights come from, as a deployment names them (DESIGN §19):
C{hf://ORG/REPO[@REVISION]} (the whole repository, or one C{file} of it),
C{https://...} (one file, checked against the C{sha256} beside it) or
C{file:///PATH} (a path on the node).

L{parse_source} turns the catalog's text into a L{ModelSource}, or says
what is wrong with it. Pure: no I/O, nothing about caches or fetching.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import quote, unquote, urlsplit

#: The schemes a source may have, as written before C{://}.
SCHEMES = ("hf", "https", "file")

# Hugging Face repository names: letters, digits, '-', '_', '.', at most 96,
# no '--' or '..', neither first nor last a '-' or '.'.
_HF_NAME = re.compile(r"^(?![-.])(?!.*(?:--|\.\.))[A-Za-z0-9._-]{1,96}(?<![-.])$")
# A branch, tag or commit: git's ref characters, no '..', no leading '/' or '-'.
_REVISION = re.compile(r"^(?![-/])(?!.*\.\.)[A-Za-z0-9._/-]{1,255}(?<!/)$")
_SHA256 = re.compile(r"^[0-9a-fA-F]{64}$")


class SourceError(ValueError):
    """
    A source was refused; the message says what is wrong with it and
    C{field} which of the catalog's fields is wrong (C{"source"}, C{"file"}
    or C{"sha256"}); the caller adds where it was written.
    """

    def __init__(self, message: str, field: str = "source"):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class ModelSource:
    """
    A parsed source. C{scheme} says which of the other fields mean
    anything: C{repo}, C{revision} and C{file} for C{hf}; C{url} and
    C{sha256} for C{https}; C{path} for C{file}. The others are "".
    """

    scheme: str
    #: hf: C{ORG/REPO}.
    repo: str = ""
    #: hf: a branch, tag or commit; "" means the repository's default.
    revision: str = ""
    #: hf: one file of the repository (a path inside it); "" for all of it.
    file: str = ""
    #: https: the file's URL.
    url: str = ""
    #: https: the file's SHA-256, lowercase hex.
    sha256: str = ""
    #: file: the absolute path on the node.
    path: str = ""

    @property
    def uri(self) -> str:
        """
        The source as a catalog writes it (without C{file} and C{sha256},
        which a catalog writes beside it).
        """
        if self.scheme == "hf":
            return f"hf://{self.repo}" + (f"@{self.revision}" if self.revision else "")
        if self.scheme == "https":
            return self.url
        if self.scheme == "file":
            return "file://" + quote(self.path)
        return f"{self.scheme}://"

    @property
    def single_file(self) -> bool:
        """
        Whether the weights are one file (an engine is given its path)
        rather than a directory.
        """
        return self.scheme == "https" or bool(self.file)

    def problem(self) -> str | None:
        """
        What is wrong with this source, or C{None}: the checks of
        L{parse_source}, for a source that came another way (the wire, a
        state file).
        """
        try:
            again = parse_source(self.uri, file=self.file, sha256=self.sha256)
        except SourceError as e:
            return str(e)
        return None if again == self else f"source {self!r} is not in its canonical form"


def _check_repo_file(name: str) -> None:
    parts = name.split("/")
    if name.startswith("/") or "\\" in name or any(p in ("", ".", "..") for p in parts):
        raise SourceError(
            f"file {name!r} must be a relative path inside the repository "
            "(no leading '/', no '.' or '..' parts, no empty parts)",
            "file",
        )
    if any(ord(c) < 32 for c in name):
        raise SourceError(f"file {name!r} has control characters", "file")


def parse_source(text: str, file: str = "", sha256: str = "") -> ModelSource:
    """
    The source C{text} names, with C{file} (one file of an hf repository)
    and C{sha256} (an https file's checksum) as the catalog gives them
    beside it.

    @raise SourceError: an unknown scheme, a malformed repository,
        revision, URL or path, C{file} on a source other than hf, an https
        source without a C{sha256} (or a C{sha256} on any other), a
        checksum that is not 64 hex digits. The message names which.
    """
    scheme, sep, rest = text.partition("://")
    if not sep:
        raise SourceError(
            f"{text!r} is not a source: write hf://ORG/REPO[@REVISION], https://... or file:///PATH"
        )
    if scheme not in SCHEMES:
        known = ", ".join(f"{s}://" for s in SCHEMES)
        hint = "; plain http is not accepted for weights: use https" if scheme == "http" else ""
        raise SourceError(f"{text!r} has unknown scheme {scheme!r} (known: {known}){hint}")
    if file and scheme != "hf":
        raise SourceError(
            f"applies to hf:// sources only (one file of a repository); {scheme}:// sources "
            "name their file themselves",
            "file",
        )
    if sha256 and scheme != "https":
        raise SourceError(
            "applies to https:// sources only (hf files are checked against the hub's own "
            "checksums; file:// paths are used as they are)",
            "sha256",
        )
    if scheme == "hf":
        repo, at, revision = rest.partition("@")
        parts = repo.split("/")
        if len(parts) != 2 or not all(_HF_NAME.fullmatch(p) for p in parts):
            raise SourceError(
                f"{text!r}: the repository must be ORG/REPO (letters, digits, '-', '_', '.'; "
                f"at most 96 each), not {repo!r}"
            )
        if at and not _REVISION.fullmatch(revision):
            raise SourceError(
                f"{text!r}: revision {revision!r} is not a branch, tag or commit (letters, "
                "digits, '.', '_', '-', '/'; no '..'; not starting with '-' or '/')"
            )
        if file:
            _check_repo_file(file)
        return ModelSource(scheme="hf", repo=repo, revision=revision, file=file)
    if scheme == "https":
        try:
            split = urlsplit(text)
            split.port  # noqa: B018 - raises on a port that is not a number
        except ValueError as e:
            raise SourceError(f"{text!r} is not a URL: {e}") from None
        if not split.hostname:
            raise SourceError(f"{text!r} names no host")
        if split.username or split.password:
            raise SourceError(
                f"{split.scheme}://{split.hostname}...: credentials do not belong in a source "
                "(they would show in the catalog, events and the admin API)"
            )
        if not split.path or split.path.endswith("/"):
            raise SourceError(f"{text!r} names no file (an https source is one file)")
        if any(c.isspace() or ord(c) < 32 for c in text):
            raise SourceError(f"{text!r} has spaces or control characters (percent-encode them)")
        if not sha256:
            raise SourceError(f"{text!r} needs a 'sha256' beside it: the file is checked against it",
                              "sha256")
        if not _SHA256.fullmatch(sha256):
            raise SourceError(f"must be 64 hex digits, not {sha256!r}", "sha256")
        return ModelSource(scheme="https", url=text, sha256=sha256.lower())
    # file://: a path on the node; no host, as in file:///srv/models/x.gguf.
    if not rest.startswith("/"):
        raise SourceError(
            f"{text!r}: a file source is file:///ABSOLUTE/PATH (three slashes; no host)"
        )
    path = unquote(rest)
    if "\0" in path or any(p in (".", "..") for p in path.split("/")):
        raise SourceError(f"{text!r}: the path must be absolute with no '.' or '..' parts")
    return ModelSource(scheme="file", path=path)
