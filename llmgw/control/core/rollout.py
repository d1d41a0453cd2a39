"""
What a rollout (DESIGN §23) is made of, as plain data: the launch spec a
replica runs (L{LaunchSpec}), a deployment's rollout from one spec to
another (L{Rollout}), and the book the context keeps of them
(L{RolloutBook}). The decisions that move a rollout on are in
L{llmgw.control.core.rolling}.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from llmgw.control.core.adapters import Adapter
from llmgw.control.core.catalog import Catalog, Profile
from llmgw.sourcespec import ModelSource

#: How many replicas of the new version a rollout adds beyond the
#: deployment's count where there is room, and how many of its replicas
#: may be down at once where there is not (the deployment's
#: C{max_surge} and C{max_unavailable} when it sets them).
DEFAULT_MAX_SURGE = 1
DEFAULT_MAX_UNAVAILABLE = 1


class RolloutState(StrEnum):
    PROGRESSING = "progressing"
    PAUSED = "paused"
    FAILED = "failed"
    DONE = "done"


@dataclass(frozen=True)
class LaunchSpec:
    """
    What a replica is launched from: its profile, and its deployment's
    source and engine arguments. Two replicas with equal specs run the
    same version.

    A deployment with variants gives one spec for all of them: C{profile}
    is the cheapest's, C{variants} the others' in order of cost, and each
    replica runs the one it was placed on (L{profile_named}).
    """

    profile: Profile
    source: ModelSource | None = None
    args: tuple[str, ...] = ()
    variants: tuple[Profile, ...] = ()
    #: The adapters its replicas start with (L{Deployment.adapters}).
    adapters: tuple[Adapter, ...] = ()

    def choices(self) -> tuple[Profile, ...]:
        """
        The profiles a replica may be placed on, the one to try first first.
        """
        return (self.profile, *self.variants)

    def profile_named(self, name: str) -> Profile | None:
        if self.profile.name == name:  # the one profile, without variants
            return self.profile
        for p in self.variants:
            if p.name == name:
                return p
        return None

    def runs_as(self, other: LaunchSpec, profile: str) -> bool:
        """
        Whether a replica on profile C{profile} placed from this spec runs
        what one placed on it from C{other} would: changes to the other
        variants or their costs leave it be.
        """
        if self == other:
            return True
        mine = self.profile_named(profile)
        return (mine is not None and mine == other.profile_named(profile)
                and self.source == other.source and self.args == other.args
                and self.adapters == other.adapters)

    @property
    def version(self) -> str:
        """
        A short name for the spec: the profile's name and a digest of
        everything that launches it (stable across processes).
        """
        digest = hashlib.sha256(repr(spec_data(self)).encode()).hexdigest()[:8]
        return f"{self.profile.name}@{digest}"


def spec_of(catalog: Catalog, model: str) -> LaunchSpec | None:
    """
    The launch spec C{catalog} gives C{model}'s deployment; C{None} for a
    model it does not serve.
    """
    dep = catalog.deployments.get(model)
    if dep is None:
        return None
    return LaunchSpec(catalog.profiles[dep.profile], dep.source, dep.args,
                      tuple(catalog.profiles[p] for p in dep.profile_names[1:]), dep.adapters)


def spec_data(spec: LaunchSpec) -> dict[str, Any]:
    """
    C{spec} as a JSON document (L{spec_from_data} reads it back).
    """
    data: dict[str, Any] = {
        "profile": _profile_data(spec.profile),
        "source": dataclasses.asdict(spec.source) if spec.source is not None else None,
        "args": list(spec.args),
    }
    if spec.variants:
        data["variants"] = [_profile_data(p) for p in spec.variants]
    if spec.adapters:
        data["adapters"] = [dataclasses.asdict(a) for a in spec.adapters]
    return data


#: Profile fields left out of a spec's document at their defaults, so that
#: versions written before they existed stay the same.
_LATER_FIELDS = ("gpu_types", "prefer_gpu_types", "max_loras")


def _profile_data(profile: Profile) -> dict[str, Any]:
    out = {k: (list(v) if isinstance(v, tuple) else dict(v) if isinstance(v, Mapping) else v)
           for k, v in ((f.name, getattr(profile, f.name)) for f in dataclasses.fields(Profile))}
    for key in _LATER_FIELDS:
        if not out[key]:
            del out[key]
    return dict(sorted(out.items()))


def _profile_from(data: Mapping[str, Any]) -> Profile:
    raw = dict(data)
    known = {f.name for f in dataclasses.fields(Profile)}
    if set(raw) - known or "name" not in raw:
        raise ValueError(f"a kept profile has unknown fields {sorted(set(raw) - known)}")
    for key in ("command", "worker_command", "gpu_types", "prefer_gpu_types"):
        raw[key] = tuple(str(a) for a in raw.get(key, ()))
    return Profile(**raw)


def spec_from_data(data: Mapping[str, Any]) -> LaunchSpec:
    """
    The spec L{spec_data} wrote.

    @raise ValueError: C{data} is not such a document (also L{KeyError},
        L{TypeError}).
    """
    source = data.get("source")
    return LaunchSpec(_profile_from(data["profile"]), ModelSource(**source) if source is not None else None,
                      tuple(str(a) for a in data.get("args", ())),
                      tuple(_profile_from(p) for p in data.get("variants", ())),
                      tuple(Adapter(a["name"], a["base"], ModelSource(**a["source"]))
                            for a in data.get("adapters", ())))


@dataclass
class Rollout:
    """
    One deployment's replacement of the replicas of spec C{old} by
    replicas of spec C{new}, one at a time.

    @ivar old_ids: the replicas still to be replaced (those of C{old} when
        it started; a replica placed back to C{old} after a failure joins).
    @ivar pending: replicas of C{new} placed and not yet ready.
    @ivar total: how many replicas it replaces in all.
    @ivar updated: how many of them are replaced (their successor ready).
    """

    model: str
    old: LaunchSpec
    new: LaunchSpec
    total: int
    started: float
    state: RolloutState = RolloutState.PROGRESSING
    old_ids: set[str] = field(default_factory=set)
    pending: set[str] = field(default_factory=set)
    updated: int = 0
    reason: str = ""
    #: Whether this rollout undoes the one before (its C{new} is the spec
    #: that one replaced).
    undo: bool = False
    #: The last time no room was found for a step ("" once there was).
    waiting: str = ""

    def owns(self) -> bool:
        """
        Whether it decides the deployment's replicas (the scaler leaves
        them alone): until it is done.
        """
        return self.state != RolloutState.DONE

    def view(self) -> dict[str, Any]:
        """
        What the deployments view shows of it.
        """
        return {
            "state": str(self.state), "updated": self.updated, "total": self.total,
            "old_version": self.old.version, "new_version": self.new.version,
            "reason": self.reason, "undo": self.undo,
        }

    def text(self) -> str:
        """
        One line for the fleet page and C{llmgw ctl rollout status}.
        """
        line = f"rollout {self.state} {self.updated}/{self.total}: {self.old.version} -> {self.new.version}"
        return f"{line} ({self.reason})" if self.reason else line


class RolloutBook:
    """
    Every deployment's last rollout, the spec each replica was placed
    with, and the deployments whose replicas are placed from another spec
    than the catalog's (C{pinned}: after an undo).
    """

    def __init__(self) -> None:
        self.rollouts: dict[str, Rollout] = {}
        self.pinned: dict[str, LaunchSpec] = {}
        self.replica_specs: dict[str, LaunchSpec] = {}
        #: Deployments an operator paused (kept across restarts): a
        #: rollout that starts for one starts paused.
        self.paused: set[str] = set()

    def effective(self, catalog: Catalog, model: str) -> LaunchSpec | None:
        """
        The spec new replicas of C{model} are placed from.
        """
        return self.pinned.get(model) or spec_of(catalog, model)

    def owns(self, model: str) -> bool:
        ro = self.rollouts.get(model)
        return ro is not None and ro.owns()

    def spec_for(self, replica_id: str) -> LaunchSpec | None:
        return self.replica_specs.get(replica_id)

    def forget(self, live: Mapping[str, Any]) -> None:
        """
        Drop the specs of replicas no longer in C{live}, once they
        outnumber the live ones.
        """
        if len(self.replica_specs) > 2 * len(live) + 100:
            self.replica_specs = {r: s for r, s in self.replica_specs.items() if r in live}
