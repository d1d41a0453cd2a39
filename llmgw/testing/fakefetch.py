"""
Test tools for the model cache: a fetcher that serves models from memory
(and can be told to serve wrong bytes), and a thread runner that runs
nothing until the test says so, so a test steps a fetch through its stages
on its own clock, with no threads.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from twisted.internet.defer import Deferred, maybeDeferred
from zope.interface import implementer

from llmgw.models.errors import SourceNotFound
from llmgw.models.fetching import FileSpec, IFetcher, Plan, Transfer, check_file, matches
from llmgw.models.source import Source


@implementer(IFetcher)
class FakeFetcher:
    """
    Serves C{models}: for each source's C{str}, its files by path. Records
    every plan and every file it wrote (C{plans}, C{written}); a path in
    C{corrupt} is written with wrong bytes; C{sizes_known=False} plans
    without sizes.
    """

    def __init__(self, models: dict[str, dict[str, bytes]], sizes_known: bool = True) -> None:
        self.models = models
        self.sizes_known = sizes_known
        self.corrupt: set[str] = set()
        self.plans: list[str] = []
        self.written: list[str] = []

    def plan(self, source: Source) -> Plan:
        self.plans.append(str(source))
        files = self.models.get(str(source))
        if files is None:
            raise SourceNotFound(f"{source}: not in the fake")
        return Plan(files=tuple(
            FileSpec(path, len(data) if self.sizes_known else None, hashlib.sha256(data).hexdigest())
            for path, data in sorted(files.items())), revision="fake")

    def fetch(self, source: Source, plan: Plan, directory: Path, transfer: Transfer) -> None:
        files = self.models[str(source)]
        for spec in plan.files:
            path = directory / spec.path
            if matches(path, spec):
                transfer.add(path.stat().st_size)
                continue
            data = files[spec.path]
            if spec.path in self.corrupt:
                data = b"x" + data[1:]
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            self.written.append(spec.path)
            transfer.add(len(data))
            check_file(path, spec, str(source))


class StepRunner:
    """
    A L{llmgw.models.cache.ThreadRunner} that queues each call; L{step}
    runs the oldest on the test's own thread, L{drain} runs until none is left.
    """

    def __init__(self) -> None:
        self.queue: list[tuple[Deferred[Any], Callable[..., Any], tuple[Any, ...], dict[str, Any]]] = []

    def __call__(self, f: Callable[..., Any], *args: Any, **kwargs: Any) -> Deferred[Any]:
        d: Deferred[Any] = Deferred()
        self.queue.append((d, f, args, kwargs))
        return d

    def step(self) -> Callable[..., Any]:
        """
        Run the oldest queued call; returns the callable that was run.
        """
        d, f, args, kwargs = self.queue.pop(0)
        maybeDeferred(f, *args, **kwargs).chainDeferred(d)
        return f

    def drain(self, limit: int = 1000) -> None:
        for _ in range(limit):
            if not self.queue:
                return
            self.step()
        raise AssertionError("the runner never ran dry")
