"""
What an operator set through the admin API that must outlive the process:
scale overrides, autoscaling bounds, cordons and drains (and, where an HA
control plane keeps them, holds), as a JSON file beside the catalog.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from twisted.logger import Logger

from llmgw.control.core.autoscale import AutoscalePolicy
from llmgw.control.core.catalog import Deployment
from llmgw.control.core.failures import Hold
from llmgw.wire import validate_node_id


class KeptState:
    """
    What an operator set through the admin API that must survive a
    restart, kept in a JSON file beside the catalog (C{CATALOG.scale.json}):
    scale overrides, cordoned nodes and nodes being drained.

    Each scale override remembers the replica count the catalog declared
    when it was made. If the catalog's own count is edited since, the edit
    is the newer intent and the override is dropped.

    The file is rewritten whole on every change: to a temporary file beside
    it, flushed to disk, then renamed over it, so a crash leaves either the
    old file or the new one. Files written before cordons were kept (only
    C{"replicas"}) load as they are, with nothing cordoned. Without a path
    (no catalog file) nothing is written or read.
    """

    def __init__(self, path: str | os.PathLike[str] | None):
        self.path = Path(path) if path is not None else None
        #: model -> (replicas, the catalog's replicas when it was set)
        self.overrides: dict[str, tuple[int, int]] = {}
        #: Autoscaling bounds set by an operator: model -> (min, max, the
        #: catalog's min and max when they were set).
        self.bounds: dict[str, tuple[int, int, int, int]] = {}
        #: Nodes that take no new placements.
        self.cordoned: frozenset[str] = frozenset()
        #: Nodes whose replicas are being moved off (always also cordoned).
        self.draining: frozenset[str] = frozenset()
        #: Held deployments (model -> hold), kept only where
        #: L{keeps_holds} (an HA control plane's etcd); standalone a hold
        #: lasts as long as the process.
        self.held: dict[str, Hold] = {}
        #: Each deployment's rollout control an operator set: C{"paused"}
        #: (bool), and after an undo C{"pinned"} (the spec it returned to,
        #: L{llmgw.control.core.rollout.spec_data}) with C{"catalog_version"}
        #: (the catalog's spec then: an edit since is the newer intent).
        self.rollouts: dict[str, dict[str, Any]] = {}

    log = Logger()

    #: Whether the reconciler keeps its holds here (L{set_holds}).
    keeps_holds = False

    @classmethod
    def beside(cls, catalog_path: str | None) -> KeptState:
        return cls(catalog_path + ".scale.json" if catalog_path else None)

    def load(self) -> list[str]:
        """
        Read the file if there is one; returns warnings about what was
        skipped. A damaged file is ignored whole, never fatal: it is moved
        aside to C{FILE.unreadable} (so the next change does not overwrite
        what an operator may want to recover) and the state starts empty.
        """
        self.overrides, self.cordoned, self.draining = {}, frozenset(), frozenset()
        self.bounds, self.rollouts = {}, {}
        if self.path is None or not self.path.exists():
            return []
        try:
            self.take_data(json.loads(self.path.read_text()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            aside = self.path.with_name(self.path.name + ".unreadable")
            try:
                os.replace(self.path, aside)
                kept = f"; it was moved to {str(aside)!r}"
            except OSError as moved:
                kept = f"; it could not be moved aside ({moved}) and will be overwritten on the next change"
            return [
                f"state file {str(self.path)!r} is unreadable and was ignored "
                f"(no scale overrides, no node cordoned or draining): {e}{kept}"
            ]
        return []

    def take_data(self, data: Any) -> None:
        """
        Replace the state with C{data}, the JSON form L{to_data} makes (the
        file's, and etcd's in HA mode).

        @raise ValueError: C{data} is not such a document (also
            L{KeyError}, L{TypeError}, L{AttributeError}); nothing changed.
        """
        if not isinstance(data, dict):
            raise ValueError(f"expected a JSON object, not {type(data).__name__}")
        overrides = {}
        for model, entry in data.get("replicas", {}).items():
            replicas, base = int(entry["replicas"]), int(entry["catalog_replicas"])
            if replicas >= 0:
                overrides[str(model)] = (replicas, base)
        bounds: dict[str, tuple[int, int, int, int]] = {}
        for model, entry in data.get("bounds", {}).items():
            lo, hi, clo, chi = (int(entry[k]) for k in ("min", "max", "catalog_min", "catalog_max"))
            if 0 <= lo <= hi and hi >= 1:
                bounds[str(model)] = (lo, hi, clo, chi)
        cordoned = self._node_list(data, "cordoned")
        draining = self._node_list(data, "draining")
        held = self._holds(data.get("held", {}))
        rollouts = data.get("rollouts", {})
        if not isinstance(rollouts, dict) or not all(isinstance(v, dict) for v in rollouts.values()):
            raise ValueError("'rollouts' must be an object of model: object")
        self.overrides = overrides
        self.bounds = bounds
        # A drain cordons its node; a file edited by hand may say otherwise.
        self.cordoned, self.draining = cordoned | draining, draining
        self.held = held
        self.rollouts = {str(m): dict(v) for m, v in rollouts.items()}

    def _holds(self, raw: Any) -> dict[str, Hold]:
        """
        The holds in C{raw} (the document's C{"held"}); a malformed entry is
        skipped with a warning, not fatal: the rest of the fleet state
        (overrides, cordons, drains) matters more than one hold, which the
        reconciler finds again at the deployment's next crash.
        """
        if not isinstance(raw, dict):
            self.log.warn("fleet state: 'held' must be an object of model: hold, not {kind}; no "
                          "deployment held", kind=type(raw).__name__)
            return {}
        held: dict[str, Hold] = {}
        for model, entry in raw.items():
            try:
                held[str(model)] = Hold(str(entry["reason"]), str(entry.get("crash_class", "")),
                                        float(entry.get("since", 0.0)))
            except (KeyError, TypeError, ValueError, AttributeError) as e:
                self.log.warn("fleet state: the hold of {model} is malformed ({error}); skipped",
                              model=str(model)[:200], error=repr(e)[:200])
        return held

    @staticmethod
    def _node_list(data: Mapping[str, Any], key: str) -> frozenset[str]:
        raw = data.get(key, [])
        if not isinstance(raw, list):
            raise ValueError(f"{key!r} must be a list of node ids, not {type(raw).__name__}")
        for node_id in raw:
            if not isinstance(node_id, str):
                raise ValueError(f"{key!r} holds {node_id!r}, which is not a node id")
            validate_node_id(node_id)
        return frozenset(raw)

    def save(self) -> None:
        """
        Write the whole state atomically; raises L{OSError} if it cannot,
        leaving the previous file in place.
        """
        if self.path is None:
            return
        write_atomically(self.path, json.dumps(self.to_data(), indent=2) + "\n")

    def to_data(self) -> dict[str, Any]:
        """The state as a JSON document (what L{take_data} reads)."""
        data: dict[str, Any] = {
            "replicas": {
                m: {"replicas": r, "catalog_replicas": b} for m, (r, b) in sorted(self.overrides.items())
            },
            "cordoned": sorted(self.cordoned),
            "draining": sorted(self.draining),
        }
        if self.bounds:
            data["bounds"] = {
                m: {"min": lo, "max": hi, "catalog_min": clo, "catalog_max": chi}
                for m, (lo, hi, clo, chi) in sorted(self.bounds.items())
            }
        if self.held:
            data["held"] = {m: h.as_dict() for m, h in sorted(self.held.items())}
        if self.rollouts:
            data["rollouts"] = {m: dict(v) for m, v in sorted(self.rollouts.items())}
        return data

    def set_rollouts(self, rollouts: Mapping[str, Mapping[str, Any]]) -> bool:
        """
        Keep each deployment's rollout control (L{rollouts}); writes only
        when it changed, and returns whether it did. Raises L{OSError} if
        the write failed (the new value is kept in memory).
        """
        new = {m: dict(v) for m, v in rollouts.items()}
        if new == self.rollouts:
            return False
        self.rollouts = new
        self.save()
        return True

    def set_holds(self, held: Mapping[str, Hold]) -> bool:
        """
        Keep the held deployments (where L{keeps_holds}); returns
        whether they changed. Here (the file) they are kept in memory only.
        """
        new = dict(held)
        if new == self.held:
            return False
        self.held = new
        return True

    def set(self, model: str, replicas: int, catalog_replicas: int) -> None:
        """
        Keep a scale override; on a failure to write, nothing changes.
        """
        before = self.overrides.get(model)
        self.overrides[model] = (replicas, catalog_replicas)
        try:
            self.save()
        except OSError:
            if before is None:
                del self.overrides[model]
            else:
                self.overrides[model] = before
            raise

    def set_bounds(self, model: str, low: int, high: int, policy: AutoscalePolicy) -> None:
        """
        Keep an operator's autoscaling bounds for C{model}, whose catalog
        policy is C{policy}; on a failure to write, nothing changes.
        """
        before = self.bounds.get(model)
        self.bounds[model] = (low, high, policy.min_replicas, policy.max_replicas)
        try:
            self.save()
        except OSError:
            if before is None:
                del self.bounds[model]
            else:
                self.bounds[model] = before
            raise

    def policy(self, dep: Deployment) -> AutoscalePolicy | None:
        """
        C{dep}'s autoscaling policy with the operator's bounds, while the
        catalog still says what it said when they were set (an edit of the
        catalog's bounds is the newer intent); C{None} for a fixed count.
        """
        if dep.autoscale is None:
            return None
        entry = self.bounds.get(dep.model)
        if entry is not None and entry[2:] == (dep.autoscale.min_replicas, dep.autoscale.max_replicas):
            return dep.autoscale.bounded(entry[0], entry[1])
        return dep.autoscale

    def set_nodes(self, cordoned: Iterable[str], draining: Iterable[str]) -> bool:
        """
        Keep the cordoned and draining nodes. Writes only when they changed;
        returns whether it wrote. Raises L{OSError} if the write failed (the
        new sets are kept in memory, so the next change writes them too).
        """
        cordoned, draining = frozenset(cordoned), frozenset(draining)
        if (cordoned, draining) == (self.cordoned, self.draining):
            return False
        self.cordoned, self.draining = cordoned, draining
        self.save()
        return True

    def desired(self, dep: Deployment) -> int:
        """
        The replica count for C{dep}: the override while the catalog still
        says what it said when the override was made, else the catalog's.
        """
        if dep.autoscale is not None:
            policy = self.policy(dep)
            return policy.min_replicas if policy is not None else dep.replicas
        entry = self.overrides.get(dep.model)
        if entry is not None and entry[1] == dep.replicas:
            return entry[0]
        return dep.replicas



def write_atomically(path: Path, text: str | bytes, keep_mode: bool = False, mode: int | None = None) -> None:
    """
    Replace C{path} with C{text}: written to C{path.tmp}, flushed to disk,
    then renamed over C{path}, so a reader (or a crash) sees the old file or
    the new one, never part of one. The temporary file is removed on failure.
    With C{keep_mode}, the new file has the old one's permissions; with
    C{mode}, exactly those, whatever the umask, from the moment it is made
    (a secret's file is never readable by others, not even before a chmod).
    """
    data = text.encode("utf-8") if isinstance(text, str) else text
    tmp = path.with_name(path.name + ".tmp")
    create = mode if mode is not None else os.stat(path).st_mode & 0o7777 if keep_mode else 0o666
    try:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()  # a crash's leftover, maybe with other permissions
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, create), "wb") as fh:
            if mode is not None:
                os.fchmod(fh.fileno(), mode)  # the umask may have taken bits the owner needs
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    # Make the rename itself durable; not every platform lets a directory be
    # opened, and the file is already complete, so this is best effort.
    with contextlib.suppress(OSError):
        dirfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dirfd)
        finally:
            os.close(dirfd)
