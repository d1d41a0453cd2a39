"""
A model's source, as a deployment names it, parsed and checked:

  - C{hf://ORG/REPO[@REVISION]}: a Hugging Face repository, the whole
    snapshot at C{REVISION} (C{main} when none is given), or one C{file}
    of it; C{allow} patterns (C{fnmatch}, on paths in the repository) keep
    only some files of a snapshot;
  - C{https://HOST/PATH}: one file, with the C{sha256} it must have;
  - C{file:///ABS/PATH}: a file or directory already on the node, used
    in place.

The parsing and checking is L{llmgw.sourcespec}'s (the catalog's); this
module is the cache's form of a source: L{from_spec} converts a
L{llmgw.sourcespec.ModelSource}, and L{parse_source} parses and converts,
raising L{SourceInvalid} naming what was wrong. L{cache_key} is the stable
name of a source's copy in a node's cache.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import PurePosixPath
from urllib.parse import unquote, urlsplit

from llmgw.models.errors import SourceInvalid
from llmgw.sourcespec import ModelSource, SourceError
from llmgw.sourcespec import parse_source as parse_spec

__all__ = ["HubSource", "HttpsSource", "LocalSource", "Source", "parse_source", "from_spec", "cache_key"]

#: The revision a hub source without C{@REVISION} means.
DEFAULT_REVISION = "main"


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


def from_spec(spec: ModelSource, allow: tuple[str, ...] | list[str] = ()) -> Source:
    """
    The cache's form of a source the catalog (or the wire) carries: a hub
    source without a revision means C{main}; C{allow} patterns limit a hub
    snapshot. C{spec} is checked again (L{ModelSource.problem}), as one
    from the wire or a state file did not come through L{parse_source}.

    @raise SourceInvalid: C{spec} is malformed, or C{allow} is given for a
        source other than a hub snapshot.
    """
    problem = spec.problem()
    if problem is not None:
        raise SourceInvalid(problem)
    allow = tuple(allow)
    if allow and spec.scheme != "hf":
        raise SourceInvalid(f"{spec.uri}: allow patterns are for hf:// snapshots only")
    if spec.scheme == "hf":
        if allow and spec.file:
            raise SourceInvalid(f"{spec.uri}: give either file or allow patterns, not both")
        for pattern in allow:
            if not isinstance(pattern, str) or not pattern:
                raise SourceInvalid(f"{spec.uri}: allow patterns must be non-empty strings")
        return HubSource(repo=spec.repo, revision=spec.revision or DEFAULT_REVISION,
                         file=spec.file or None, allow=allow)
    if spec.scheme == "https":
        return HttpsSource(url=spec.url, sha256=spec.sha256)
    return LocalSource(path=spec.path.rstrip("/") or "/")


def parse_source(
    source: str, file: str | None = None, sha256: str | None = None,
    allow: tuple[str, ...] | list[str] = (),
) -> Source:
    """
    The source named by C{source} with its C{file}, C{sha256} and C{allow}
    settings beside it: L{llmgw.sourcespec.parse_source}'s checks (the one
    parser), then L{from_spec}.

    @raise SourceInvalid: what L{llmgw.sourcespec.parse_source} refuses,
        its message prefixed by the setting at fault when that is not the
        source itself; or C{allow} where it does not apply.
    """
    try:
        spec = parse_spec(source, file=file or "", sha256=sha256 or "")
    except SourceError as e:
        message = str(e)
        if not message.startswith((e.field, repr(source))):
            # The catalog adds which setting is at fault; so does this.
            message = f"{e.field} {message}"
        raise SourceInvalid(message) from None
    return from_spec(spec, allow)


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


def spec_key(spec: ModelSource | None) -> str:
    """
    The cache key of C{spec}'s copy on a node, the same at both ends of the
    agent stream (so the control plane can tell which nodes hold what a
    deployment needs); "" where nothing is cached for it (no source, a path
    on the node, or one the cache refuses).
    """
    if spec is None:
        return ""
    try:
        source = from_spec(spec)
    except SourceInvalid:
        return ""
    if isinstance(source, LocalSource):
        return ""
    return cache_key(source)
