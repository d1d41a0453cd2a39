"""
Hugging Face repositories, through the C{huggingface_hub} library and its
own settings as the agent's environment gives them (C{HF_ENDPOINT} for a
mirror, C{HF_TOKEN} or C{HF_TOKEN_PATH} for a token, C{HF_HUB_*}), as any
tool built on it does. A token is never put in a message here.

The plan comes from the repository's tree at a commit (C{list_repo_tree},
or C{get_paths_info} for one file): each file's size, and the checksum the
hub holds for it, the sha256 of an LFS file or the git blob id of another.
Each file is streamed in the fetch's thread from the library's own URL
(C{hf_hub_url}), with its headers (C{build_hf_headers}) and HTTP session
(C{get_session}), into C{NAME.part}, hashed as it is written, resumed with
a C{Range} request from the part an earlier fetch left, and takes its name
only once its size and the hub's checksum match: what counts is the hub's
metadata, not the bytes a CDN or mirror sent. Hashing while the bytes
arrive spares the second read of the whole file a check afterwards costs.
"""

from __future__ import annotations

import fnmatch
import hashlib
from pathlib import Path
from typing import IO, Any, Literal

from zope.interface import implementer

from llmgw.models.errors import ChecksumMismatch, ModelError, SourceDenied, SourceNotFound
from llmgw.models.fetching import (
    READ_CHUNK,
    Cut,
    FileSpec,
    IFetcher,
    Plan,
    Transfer,
    hash_part,
    matches,
    resumed,
)
from llmgw.models.source import HubSource, Source

#: Suffix of a file being downloaded, kept across restarts for a resume.
PART = ".part"


def _digest(spec: FileSpec) -> Any:
    """
    A hash object for C{spec}'s checksum, fed nothing yet (a git blob id's
    header included); C{None} when the file is checked by size alone.
    """
    if spec.sha256 is not None:
        return hashlib.sha256()
    if spec.git_sha1 is not None and spec.size is not None:
        return hashlib.sha1(f"blob {spec.size}\0".encode(), usedforsecurity=False)
    return None


@implementer(IFetcher)
class HubFetcher:
    """
    Fetches L{HubSource}s. C{endpoint} and C{token} are the library's own
    arguments: C{None} (the default) lets it read C{HF_ENDPOINT} and its
    token settings from the environment. C{retries}: how many times a
    download cut mid-file is resumed before the fetch fails, C{retry_delay}
    seconds apart (slept in the fetch's own thread).
    """

    def __init__(
        self, endpoint: str | None = None, token: str | bool | None = None,
        retries: int = 3, retry_delay: float = 1.0,
    ) -> None:
        self._endpoint = endpoint
        self._token = token
        self._retries = retries
        self._retry_delay = retry_delay

    def _api(self) -> Any:
        from huggingface_hub import HfApi

        return HfApi(endpoint=self._endpoint, token=self._token)

    def plan(self, source: Source) -> Plan:
        """
        Resolve the revision to a commit and list the files at it (only
        C{file}, or those matching C{allow}, when given).
        """
        assert isinstance(source, HubSource)
        from huggingface_hub import RepoFile

        api = self._api()
        with _translated(source):
            commit = api.model_info(source.repo, revision=source.revision).sha
            if source.file is not None:
                entries = api.get_paths_info(source.repo, [source.file], revision=commit)
            else:
                entries = api.list_repo_tree(source.repo, recursive=True, revision=commit)
            files = [e for e in entries if isinstance(e, RepoFile)]
        if source.file is not None and not files:
            raise SourceNotFound(f"{source}: the repository has no file {source.file!r}")
        if source.allow:
            files = [f for f in files if any(fnmatch.fnmatch(f.path, p) for p in source.allow)]
            if not files:
                raise SourceNotFound(f"{source}: no file matches {list(source.allow)}")
        specs = tuple(
            FileSpec(path=f.path, size=f.size,
                     sha256=f.lfs.sha256 if f.lfs is not None else None,
                     git_sha1=None if f.lfs is not None else f.blob_id)
            for f in sorted(files, key=lambda f: f.path))
        return Plan(files=specs, revision=commit or source.revision, target=source.file or "")

    def fetch(self, source: Source, plan: Plan, directory: Path, transfer: Transfer) -> None:
        assert isinstance(source, HubSource)
        directory.mkdir(parents=True, exist_ok=True)
        for spec in plan.files:
            transfer.check()
            path = directory / spec.path
            if path.exists():
                if matches(path, spec, transfer):
                    transfer.add(path.stat().st_size)
                    continue
                path.unlink()
            path.parent.mkdir(parents=True, exist_ok=True)
            with _translated(source):
                self._fetch_file(source, plan.revision, spec, path, transfer)

    def _fetch_file(self, source: HubSource, revision: str, spec: FileSpec, path: Path,
                    transfer: Transfer) -> None:
        """
        Stream C{spec} into C{path}'s part, resumed and retried, and give it
        its name once it checks.

        @raise ChecksumMismatch: the whole file's size or checksum differs
            from the plan's (the part is deleted).
        """
        part = path.with_name(path.name + PART)
        digest, size = resumed(lambda: self._download(source, revision, spec, part, transfer),
                               self._retries, self._retry_delay, f"{source}: {spec.path}")
        expected = spec.sha256 or spec.git_sha1
        if (spec.size is not None and size != spec.size) or (digest is not None and digest != expected):
            part.unlink(missing_ok=True)
            transfer.add(-size)
            what = f"sha256 {spec.sha256}" if spec.sha256 else f"git blob {spec.git_sha1}" if spec.git_sha1 else ""
            raise ChecksumMismatch(
                f"{source}: {spec.path} does not match the hub's checksum ({what or 'no checksum'}, "
                f"size {spec.size}; got {size} bytes); the file was deleted")
        part.rename(path)

    def _download(self, source: HubSource, revision: str, spec: FileSpec, part: Path,
                  transfer: Transfer) -> tuple[str | None, int]:
        """
        Download into C{part} from where it ends: its checksum (C{None} when
        C{spec} has none) and its size, once the server has sent it all.

        @raise Cut: the connection ended before the file did.
        """
        import httpx2
        from huggingface_hub import constants, get_session, hf_hub_url
        from huggingface_hub.utils import build_hf_headers, hf_raise_for_status

        digest = _digest(spec)
        have = hash_part(part, digest, spec.size)
        transfer.add(have)
        if spec.size is not None and have == spec.size:
            return (digest.hexdigest() if digest is not None else None), have
        url = hf_hub_url(source.repo, spec.path, revision=revision, endpoint=self._endpoint)
        headers = build_hf_headers(token=self._token)
        # The bytes as stored are what the checksum is of, never a compressed form.
        headers["Accept-Encoding"] = "identity"
        if have:
            headers["Range"] = f"bytes={have}-"
        try:
            with get_session().stream("GET", url, headers=headers, follow_redirects=True,
                                      timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT) as response:
                hf_raise_for_status(response)
                mode = "ab"
                if have and response.status_code != 206:
                    # The server ignored the Range: start over.
                    transfer.add(-have)
                    digest, have, mode = _digest(spec), 0, "wb"
                with part.open(mode) as out:
                    have = self._stream(response, out, digest, have, transfer)
        except httpx2.TransportError as e:
            transfer.add(-have)
            raise Cut(f"connection lost after {have} bytes ({type(e).__name__})") from None
        return (digest.hexdigest() if digest is not None else None), have

    @staticmethod
    def _stream(response: Any, out: IO[Any], digest: Any, have: int, transfer: Transfer) -> int:
        """
        Write C{response}'s body to C{out} from C{have} bytes on, hashing
        and counting it; the file's size once the body ends.

        @raise Cut: the connection ended first (what arrived is written).
        """
        import httpx2

        # The transport hands over pieces of up to 64 KiB (a chunked body's
        # chunks may be smaller): they are gathered into one buffer so that
        # each write, hash update (which lets go of the GIL) and count is
        # of a whole buffer, and no piece is copied more than once.
        buffer = bytearray(READ_CHUNK)
        view = memoryview(buffer)
        filled = 0

        def flush(data: Any) -> None:
            nonlocal have
            out.write(data)
            if digest is not None:
                digest.update(data)
            have += len(data)
            transfer.add(len(data))

        try:
            for piece in response.iter_raw():
                size = len(piece)
                if filled + size > READ_CHUNK:
                    flush(view[:filled])
                    filled = 0
                if size >= READ_CHUNK:
                    flush(piece)
                    continue
                buffer[filled:filled + size] = piece
                filled += size
        except httpx2.TransportError as e:
            out.write(view[:filled])
            arrived = have + filled
            transfer.add(-have)
            raise Cut(f"connection lost after {arrived} bytes ({type(e).__name__})") from None
        flush(view[:filled])
        return have


class _translated:
    """
    Turns the library's exceptions into L{ModelError}s naming the source.
    """

    def __init__(self, source: HubSource) -> None:
        self._source = source

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: object) -> Literal[False]:
        if value is None or isinstance(value, ModelError) or not isinstance(value, Exception):
            return False
        from huggingface_hub import errors

        source = self._source
        if isinstance(value, errors.GatedRepoError):
            raise SourceDenied(f"{source}: the repository is gated; the token given may not read it") from None
        if isinstance(value, errors.RepositoryNotFoundError):
            raise SourceNotFound(
                f"{source}: no such repository, or it is private and no token that may read it "
                "was given") from None
        if isinstance(value, errors.RevisionNotFoundError):
            raise SourceNotFound(f"{source}: no revision {source.revision!r}") from None
        if isinstance(value, errors.EntryNotFoundError):
            raise SourceNotFound(f"{source}: a file listed by the hub is missing from it") from None
        raise ModelError(f"{source}: {type(value).__name__}: {value}") from None
