"""
The reconciler's rollout control for operators (DESIGN §23): status,
pause, resume and undo of a deployment's rollout
(L{llmgw.control.core.rolling}), and keeping what must outlive the
process (the paused deployments, an undo's pinned spec) in the fleet
state (L{KeptState}; an HA leader's etcd).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from llmgw.control.core import placing, rolling
from llmgw.control.core.rollout import spec_data, spec_from_data, spec_of

if TYPE_CHECKING:
    from llmgw.control.core.context import Context
    from llmgw.control.core.kept import KeptState


class RolloutControl:
    """
    Mixed into the reconciler, whose C{ctx}, C{clock}, C{fleet_state},
    C{log} and C{_decide} it uses.
    """

    ctx: Context
    fleet_state: KeptState
    clock: Any
    log: Any
    _decide: Callable[..., Any]

    def rollout_status(self, model: str) -> dict[str, Any]:
        """
        C{model}'s last rollout (C{None} when it has had none since the
        process started) and the spec its new replicas are placed from.
        """
        placing.deployment(self.ctx, model)
        book = self.ctx.rollouts
        ro = book.rollouts.get(model)
        spec = book.effective(self.ctx.catalog, model)
        return {
            "model": model, "rollout": ro.view() if ro is not None else None,
            "text": ro.text() if ro is not None else "no rollout",
            "version": spec.version if spec is not None else None,
            "pinned": model in book.pinned, "paused": model in book.paused,
        }

    def rollout_pause(self, model: str) -> dict[str, Any]:
        placing.deployment(self.ctx, model)
        self._decide(rolling.pause, model)
        self._keep_rollouts()
        return self.rollout_status(model)

    def rollout_resume(self, model: str) -> dict[str, Any]:
        placing.deployment(self.ctx, model)
        self._decide(rolling.resume, model)
        self._keep_rollouts()
        return self.rollout_status(model)

    def rollout_undo(self, model: str) -> dict[str, Any]:
        placing.deployment(self.ctx, model)
        self._decide(rolling.undo, model, self.clock.seconds())
        self._keep_rollouts()
        return self.rollout_status(model)

    def _keep_rollouts(self) -> None:
        book, catalog = self.ctx.rollouts, self.ctx.catalog
        kept: dict[str, dict[str, Any]] = {}
        for model in sorted(set(book.paused) | set(book.pinned)):
            entry: dict[str, Any] = {"paused": model in book.paused}
            pin, current = book.pinned.get(model), spec_of(catalog, model)
            if pin is not None and current is not None:
                entry["pinned"], entry["catalog_version"] = spec_data(pin), current.version
            kept[model] = entry
        try:
            self.fleet_state.set_rollouts(kept)
        except OSError as e:
            self.log.error("could not keep the rollouts' control in {path}: {error}; it will not "
                           "survive a restart", path=str(self.fleet_state.path), error=str(e))

    def take_up_rollouts(self) -> None:
        """
        Adopt the rollouts' control the fleet state holds: paused
        deployments, and undone ones whose catalog entry is as it was
        then (an edit since is the newer intent).
        """
        book, catalog = self.ctx.rollouts, self.ctx.catalog
        book.paused = {m for m, e in self.fleet_state.rollouts.items() if e.get("paused")}
        book.pinned.clear()
        for model, entry in self.fleet_state.rollouts.items():
            current = spec_of(catalog, model)
            if "pinned" not in entry or current is None or entry.get("catalog_version") != current.version:
                continue
            try:
                book.pinned[model] = spec_from_data(entry["pinned"])
            except (ValueError, KeyError, TypeError) as e:
                self.log.error("the kept undo of {model} is unreadable ({error}); the catalog's spec is used",
                               model=model, error=repr(e)[:200])
