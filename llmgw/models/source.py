"""
A model's source, as a deployment names it, parsed and checked:

  - C{hf://ORG/REPO[@REVISION]}: a Hugging Face repository, the whole
    snapshot at C{REVISION} (C{main} when none is given), or one C{file}
    of it; C{allow} patterns (C{fnmatch}, on paths in the repository) keep
    only some files of a snapshot;
  - C{https://HOST/PATH}: one file, with the C{sha256} it must have;
  - C{file:///ABS/PATH}: a file or directory already on the node, used
    in place.

L{parse_source} raises L{SourceInvalid} naming what was wrong. L{cache_key}
is the stable name of a source's copy in a node's cache.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import PurePosixPath
from urllib.parse import unquote, urlsplit

from llmgw.models.errors import SourceInvalid

__all__ = ["HubSource", "HttpsSource", "LocalSource", "Source", "parse_source", "cache_key"]

#: The revision a hub source without C{@REVISION} means.
DEFAULT_REVISION = "main"

# The hub's own rule for a name segment: letters, digits, '.', '_', '-',
# not starting or ending with '.' or '-', no '--' or '..' inside, 96 at most.
_HUB_NAME = re.compile(r"^(?!.*(?:--|\.\.))[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9_])?$")
# Branches, tags, commit ids and refs like refs/pr/1.
_REVISION = re.compile(r"^(?!.*\.\.)[A-Za-z0-9_][A-Za-z0-9._/-]{0,254}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class HubSource:
    """
    A Hugging Face repository at a revision; C{file} is one path in it or
    C{None} for the snapshot, C{allow} the patterns a snapshot is limited to.
    """

    repo: str
    revision: str = DEFAULT_REVISION
    file: str | None = None
    allow: tuple[str, ...] = ()

    kind = "hf"

    def __str__(self) -> str:
        return f"hf://{self.repo}@{self.revision}"


@dataclass(frozen=True)
class HttpsSource:
    """
    One file at an https URL and the sha256 (lower-case hex) it must have.
    """

    url: str
    sha256: str

    kind = "https"

    @property
    def filename(self) -> str:
        """
        The name the file is stored under: the URL path's last segment.
        """
        return PurePosixPath(unquote(urlsplit(self.url).path)).name

    def __str__(self) -> str:
        return self.url


@dataclass(frozen=True)
class LocalSource:
    """
    An absolute path on the node, used where it is (never copied or evicted).
    """

    path: str

    kind = "file"

    def __str__(self) -> str:
        return f"file://{self.path}"


Source = HubSource | HttpsSource | LocalSource


def _relative_path(value: str, what: str) -> str:
    parts = value.split("/")
    if (not value or value.startswith("/") or "\\" in value or "\0" in value
            or any(p in ("", ".", "..") for p in parts)):
        raise SourceInvalid(
            f"{what} {value!r} is not a plain relative path in the repository "
            "(no leading '/', no empty, '.' or '..' segments)")
    return value


def parse_source(
    source: str, file: str | None = None, sha256: str | None = None,
    allow: tuple[str, ...] | list[str] = (),
) -> Source:
    """
    The source named by C{source} with its C{file}, C{sha256} and C{allow}
    settings beside it.

    @raise SourceInvalid: the scheme is not C{hf}, C{https} or C{file}; a
        part is malformed; a setting is given that the scheme does not take
        (C{sha256} for a hub or a path, C{file} for https or a path) or one
        it needs is missing (C{sha256} for https).
    """
    if not isinstance(source, str) or not source:
        raise SourceInvalid("a model source must be a non-empty string")
    scheme, sep, rest = source.partition("://")
    scheme = scheme.lower()
    if not sep:
        raise SourceInvalid(
            f"model source {source!r} has no scheme: expected hf://ORG/REPO[@REVISION], "
            "https://... or file:///ABSOLUTE/PATH")
    if scheme == "hf":
        if sha256 is not None:
            raise SourceInvalid(
                f"{source}: sha256 is for https sources; a hub's files are checked "
                "against the hub's own checksums")
        return _parse_hub(source, rest, file, tuple(allow))
    if allow:
        raise SourceInvalid(f"{source}: allow patterns are for hf:// snapshots only")
    if file is not None:
        raise SourceInvalid(f"{source}: file is for hf:// sources only (an {scheme} source is one file)")
    if scheme == "https":
        return _parse_https(source, sha256)
    if scheme == "file":
        if sha256 is not None:
            raise SourceInvalid(f"{source}: sha256 is for https sources; a local path is used as it is")
        return _parse_local(source, rest)
    if scheme == "http":
        raise SourceInvalid(f"{source}: plain http is not accepted for weights; use https")
    raise SourceInvalid(f"model source {source!r}: unknown scheme {scheme!r} (hf, https or file)")


def _parse_hub(source: str, rest: str, file: str | None, allow: tuple[str, ...]) -> HubSource:
    repo, at, revision = rest.partition("@")
    if at and not revision:
        raise SourceInvalid(f"{source}: empty revision after '@'")
    revision = revision or DEFAULT_REVISION
    parts = repo.split("/")
    if len(parts) != 2 or not all(_HUB_NAME.match(p) for p in parts):
        raise SourceInvalid(
            f"{source}: the repository must be ORG/REPO, each of letters, digits, "
            f"'.', '_' and '-' (got {repo!r})")
    if not _REVISION.match(revision):
        raise SourceInvalid(f"{source}: revision {revision!r} is not a branch, tag or commit id")
    if file is not None:
        if not isinstance(file, str):
            raise SourceInvalid(f"{source}: file must be a string")
        _relative_path(file, f"{source}: file")
        if allow:
            raise SourceInvalid(f"{source}: give either file or allow patterns, not both")
    for pattern in allow:
        if not isinstance(pattern, str) or not pattern:
            raise SourceInvalid(f"{source}: allow patterns must be non-empty strings")
    return HubSource(repo=repo, revision=revision, file=file, allow=allow)


def _parse_https(source: str, sha256: str | None) -> HttpsSource:
    url = "https" + source[source.index("://"):]
    parts = urlsplit(url)
    if not parts.hostname:
        raise SourceInvalid(f"{source}: no host in the URL")
    if parts.username or parts.password:
        raise SourceInvalid(f"{parts.hostname}: credentials in a model URL are refused (they would be logged)")
    if not PurePosixPath(unquote(parts.path)).name:
        raise SourceInvalid(f"{source}: the URL's path names no file")
    if sha256 is None:
        raise SourceInvalid(f"{source}: an https source needs sha256 = \"<64 hex digits>\" beside it")
    if not isinstance(sha256, str) or not _SHA256.match(sha256.lower()):
        raise SourceInvalid(f"{source}: sha256 {sha256!r} is not 64 hex digits")
    return HttpsSource(url=url, sha256=sha256.lower())


def _parse_local(source: str, rest: str) -> LocalSource:
    host, slash, path = rest.partition("/")
    if host not in ("", "localhost"):
        raise SourceInvalid(f"{source}: a file source names a path on the node (file:///PATH), not host {host!r}")
    path = unquote("/" + path) if slash else ""
    if not path.startswith("/") or path == "/":
        raise SourceInvalid(f"{source}: a file source needs an absolute path (file:///PATH)")
    if any(p in (".", "..") for p in path.split("/")):
        raise SourceInvalid(f"{source}: '.' and '..' are not accepted in a file source's path")
    return LocalSource(path=path.rstrip("/") or "/")


def canonical(source: Source) -> str:
    """
    One string per distinct source: two sources are the same copy if and
    only if their canonical strings are equal.
    """
    if isinstance(source, HubSource):
        text = f"hf://{source.repo}@{source.revision}"
        if source.file is not None:
            text += f"#file={source.file}"
        if source.allow:
            text += "#allow=" + ",".join(sorted(source.allow))
        return text
    if isinstance(source, HttpsSource):
        return f"{source.url}#sha256={source.sha256}"
    return f"file://{source.path}"


def cache_key(source: Source) -> str:
    """
    The name of C{source}'s entry in a cache: readable, safe as a single
    directory name, stable across runs and versions, and distinct for
    distinct sources (a digest of L{canonical} ends it).
    """
    digest = hashlib.sha256(canonical(source).encode()).hexdigest()[:16]
    if isinstance(source, HubSource):
        readable = f"{source.repo.replace('/', '--')}--{source.revision}"
        if source.file is not None:
            readable += "--" + PurePosixPath(source.file).name
    elif isinstance(source, HttpsSource):
        readable = source.filename
    else:
        readable = PurePosixPath(source.path).name
    readable = re.sub(r"[^A-Za-z0-9._-]", "_", readable)[:80].strip(".")
    return f"{source.kind}-{readable}-{digest}"
