"""
Hugging Face repositories, through the C{huggingface_hub} library and its
own settings as the agent's environment gives them (C{HF_ENDPOINT} for a
mirror, C{HF_TOKEN} or C{HF_TOKEN_PATH} for a token, C{HF_HUB_*}), as any
tool built on it does. A token is never put in a message here.

The plan comes from the repository's tree at a commit (C{list_repo_tree},
or C{get_paths_info} for one file): each file's size, and the checksum the
hub holds for it, the sha256 of an LFS file or the git blob id of another.
C{hf_hub_download} fetches each file into the entry's directory (resuming
its own C{.incomplete} file), and every file is then hashed here: what
counts is the hub's metadata, not the bytes a CDN or mirror sent.
"""

from __future__ import annotations

import fnmatch
from pathlib import Path
from typing import Any, Literal

from zope.interface import implementer

from llmgw.models.errors import ModelError, SourceDenied, SourceNotFound
from llmgw.models.fetching import FileSpec, IFetcher, Plan, Transfer, check_file, matches
from llmgw.models.source import HubSource, Source


def _progress_class(transfer: Transfer) -> type:
    """
    A progress bar class for C{hf_hub_download} that counts into C{transfer}
    (and stops the download when it raises) and never draws.
    """
    from huggingface_hub.utils import tqdm

    class Counting(tqdm):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

        def update(self, n: float | None = 1) -> bool | None:
            transfer.add(int(n or 0))
            return super().update(n)  # type: ignore[no-any-return]

    return Counting


@implementer(IFetcher)
class HubFetcher:
    """
    Fetches L{HubSource}s. C{endpoint} and C{token} are the library's own
    arguments: C{None} (the default) lets it read C{HF_ENDPOINT} and its
    token settings from the environment.
    """

    def __init__(self, endpoint: str | None = None, token: str | bool | None = None) -> None:
        self._endpoint = endpoint
        self._token = token

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
        from huggingface_hub import hf_hub_download

        directory.mkdir(parents=True, exist_ok=True)
        progress = _progress_class(transfer)
        for spec in plan.files:
            transfer.check()
            path = directory / spec.path
            if path.exists():
                if matches(path, spec, transfer):
                    transfer.add(path.stat().st_size)
                    continue
                # Damaged: the library would keep it (its own record says
                # it is current), so it goes first.
                path.unlink()
            with _translated(source):
                hf_hub_download(
                    source.repo, spec.path, revision=plan.revision, local_dir=directory,
                    endpoint=self._endpoint, token=self._token, tqdm_class=progress)
            check_file(path, spec, str(source), transfer)


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
