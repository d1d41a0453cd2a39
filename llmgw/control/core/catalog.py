"""
The catalog (DESIGN §6.1): profiles (how a model runs on hardware) and
deployments (a model, a profile and a desired replica count), read from TOML.

Everything here is plain data and pure functions. A catalog is validated
whole: the first thing wrong is refused with a L{CatalogError} that names the
entry and the field, and nothing of a refused catalog is used.

Scale changes, cordons and node drains made through the admin API are kept
in a small JSON state file beside the catalog (C{CATALOG.scale.json}, see
L{FleetState}), not written into the operator's TOML.
"""

from __future__ import annotations

import math
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmgw import engineargv, engines, gputypes, sleepmodes
from llmgw.control.core import multiplex as mpx
from llmgw.control.core.adapters import Adapter, adapter_launch, parse_adapters, with_fixed_adapters
from llmgw.control.core.autoscale import AutoscalePolicy
from llmgw.control.core.catalogfields import AUTOSCALE_FIELDS as AUTOSCALE_FIELDS
from llmgw.control.core.catalogfields import CatalogError as CatalogError
from llmgw.control.core.catalogfields import parse_autoscale, parse_variant_fields
from llmgw.control.core.catalogfields import positive as _positive
from llmgw.routing import POLICIES, QueueLimits
from llmgw.shards import (
    DEFAULT_DRAIN_TIMEOUT_S,
    DEFAULT_ENGINE,
    DEFAULT_HEALTH_PATH,
    DEFAULT_STALL_AFTER_S,
    DEFAULT_STARTUP_TIMEOUT_S,
    DEFAULT_STOP_GRACE_S,
    DEFAULT_STOP_SIGNAL,
    ShardSpec,
)
from llmgw.sourcespec import ModelSource, SourceError, parse_source

#: Placeholders a command or env value may hold. C{{python}} is left for the
#: agent, which replaces it with its own interpreter; the control plane fills
#: in the rest per shard.
PLACEHOLDERS = frozenset({
    "python", "port", "model", "rank", "world_size", "leader", "gpus",
    # The address the agent advertises for its shards, and the leader's alone.
    "host", "leader_host",
})
AGENT_PLACEHOLDERS = frozenset({"python", "weights"})

_PLACEHOLDER = re.compile(r"\{([^{}]*)\}")
# In a deployment's args only {name} is a placeholder: engines take JSON
# values ('{"level": 3}'), which must pass as written.
_ARGS_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
#: What a deployment's args may hold: the command's placeholders and the
#: path of the weights, filled by the agent once they are on the node.
ARGS_PLACEHOLDERS = PLACEHOLDERS | {"weights"}

DEFAULT_PORT_RANGE = (20000, 29999)


@dataclass(frozen=True)
class Profile:
    """
    How a model runs: C{shards} nodes per replica, each with
    C{gpus_per_shard} GPUs that have C{gpu_memory_mb} free.

    C{command} is empty when llmgw writes it (L{llmgw.engineargv}) from the
    profile's C{engine} and a deployment's C{source}.
    """

    name: str
    command: tuple[str, ...]
    shards: int = 1
    gpus_per_shard: int = 1
    gpu_memory_mb: int = 0
    fabric: str = ""
    env: Mapping[str, str] = field(default_factory=dict)
    health_path: str = DEFAULT_HEALTH_PATH
    startup_timeout_s: int = DEFAULT_STARTUP_TIMEOUT_S
    drain_timeout_s: int = DEFAULT_DRAIN_TIMEOUT_S
    stop_grace_s: int = DEFAULT_STOP_GRACE_S
    #: Seconds a replica may run requests with its generated-token counter
    #: flat before it is wedged (out of routing, replaced); 0: never.
    stall_after_s: float = DEFAULT_STALL_AFTER_S
    #: The engine whose defaults fill what the profile leaves out.
    engine: str = DEFAULT_ENGINE
    #: What ranks 1..N-1 run; empty: the same C{command} as rank 0.
    worker_command: tuple[str, ...] = ()
    #: The workers' health path; "" means ready while the process lives.
    worker_health_path: str = ""
    #: Where the agent scrapes the leader's Prometheus metrics; "" for none.
    metrics_path: str = ""
    #: Signal -> metric names ("a,b": first present; "a+b": summed).
    metric_names: Mapping[str, str] = field(default_factory=dict)
    stop_signal: str = DEFAULT_STOP_SIGNAL
    #: The engine's executable when llmgw writes the command; "": the
    #: engine's usual one (L{engineargv.DEFAULT_PROGRAMS}) on the agent's PATH.
    program: str = ""
    #: GPU types its GPUs must be of (any, when empty) and those it
    #: prefers, most preferred first (L{llmgw.gputypes}).
    gpu_types: tuple[str, ...] = ()
    prefer_gpu_types: tuple[str, ...] = ()
    #: Most LoRA adapters a vLLM replica holds at once (loaded while it
    #: runs, L{llmgw.control.core.adapters}); 0: it serves none.
    max_loras: int = 0
    #: How deep its engine sleeps (L{llmgw.sleepmodes}); 0: it never sleeps.
    sleep_level: int = 0

    def launch(self, rank: int, deployment: Deployment | None = None) -> ShardSpec:
        """
        The spec each shard of rank C{rank} starts from: this profile's
        command and environment with their placeholders unfilled, its
        readiness, metrics, timeouts, engine and stop signal. Which shard
        it is and where it runs are left empty (shard, replica and model
        "", no GPUs, port 0) for the reconciler to fill in.

        Ranks 1..N-1 run C{worker_command} when there is one, with
        C{worker_health_path}; only rank 0 is scraped (its metrics cover the
        replica, and routes carry the leader's).

        For a C{deployment} with a C{source}, on a profile without a
        command, the command is the one llmgw writes for the profile's
        engine, serving C{{weights}} as C{{model}} on C{{host}}:C{{port}}
        with the deployment's C{args}, and the spec carries the source for
        the agent to put the weights on the node. A profile with a command
        runs it whatever the deployment says: a replica placed on it before
        its deployment moved to another profile keeps it.
        """
        argv, health_path = self.command, self.health_path
        source: ModelSource | None = None
        sleep_after = deployment.multiplex.sleep_after_s if deployment is not None and self.sleep_level else 0.0
        if (deployment is not None and deployment.source is not None and not self.command
                and self.engine in engineargv.LAUNCHABLE):
            source = deployment.source
            flags = sleepmodes.start_flags(self.engine, sleep_after) if sleep_after else ()
            argv = engineargv.build_argv(
                self.engine, weights=engineargv.WEIGHTS, host="{host}", port="{port}",
                served_name="{model}", tensor_parallel=self.gpus_per_shard,
                args=(*flags, *deployment.args), program=self.program, metrics=bool(self.metrics_path),
            )
        argv, env, fixed = adapter_launch(self, deployment, argv)
        if source is not None and sleep_after:
            env = {**sleepmodes.start_env(self.engine), **env}
        if rank > 0 and self.worker_command:
            argv, health_path = self.worker_command, self.worker_health_path
        return ShardSpec(
            shard_id="", replica_id="", model="", profile=self.name, argv=argv, gpu_indices=(),
            port=0, rank=rank, env=env, health_path=health_path, adapters=fixed,
            startup_timeout_s=self.startup_timeout_s, stop_grace_s=self.stop_grace_s,
            drain_timeout_s=self.drain_timeout_s, engine=self.engine,
            metrics_path=self.metrics_path if rank == 0 else "",
            metric_names=self.metric_names if rank == 0 else {}, stop_signal=self.stop_signal,
            source=source, stall_after_s=self.stall_after_s,
            sleep_level=self.sleep_level if rank == 0 and sleep_after else 0,
            sleep_after_s=sleep_after if rank == 0 else 0.0,
        )


@dataclass(frozen=True)
class Deployment:
    model: str
    profile: str
    replicas: int
    #: The gateway's routing policy for this model (L{llmgw.routing.POLICIES});
    #: C{None}: the gateway's default.
    routing: str | None = None
    #: Autoscaling between bounds instead of a fixed count (C{replicas} is
    #: then C{min_replicas}, the count it starts from); C{None}: fixed.
    autoscale: AutoscalePolicy | None = None
    #: The gateway's admission queue for this model: most requests waiting,
    #: and seconds each may wait (L{llmgw.gateway.admission}); C{None}: the
    #: gateway's defaults.
    queue_depth: int | None = None
    queue_timeout_s: float | None = None
    #: Whether a stream whose replica fails mid-answer goes on on another
    #: replica (L{llmgw.gateway.resume}); off where an engine or client
    #: cannot take a continued answer.
    resume_streams: bool = True
    #: Where the weights come from; C{None}: the profile's C{command} names them.
    source: ModelSource | None = None
    #: Extra engine flags after the ones llmgw writes (with C{source} only).
    args: tuple[str, ...] = ()
    #: Nodes beyond those that run it that keep its weights cached (with
    #: C{source} only), so a scale-up or a failover skips the fetch.
    prefetch: int = 0
    #: A rollout's extra replicas where there is room, and how many may be
    #: down at once where there is not (L{llmgw.control.core.rolling});
    #: C{None}: the defaults (1 and 1).
    max_surge: int | None = None
    max_unavailable: int | None = None
    #: The profiles it may run on with their costs, cheapest first (then
    #: C{profile} is the cheapest's); empty: C{profile} alone.
    variants: tuple[gputypes.Variant, ...] = ()
    #: The adapters its replicas start with (an engine that takes them only
    #: at its start), in the order of their ids; set from the catalog's
    #: C{[[adapters]]}.
    adapters: tuple[Adapter, ...] = ()
    #: Sleeping and eviction (L{llmgw.control.core.multiplex}).
    multiplex: mpx.Multiplex = mpx.Multiplex()

    @property
    def profile_names(self) -> tuple[str, ...]:
        """
        Every profile its replicas may run on, cheapest first.
        """
        return tuple(v.profile for v in self.variants) or (self.profile,)


@dataclass(frozen=True)
class Catalog:
    """
    A validated catalog. C{deployments} is keyed by model.
    """

    profiles: Mapping[str, Profile] = field(default_factory=dict)
    deployments: Mapping[str, Deployment] = field(default_factory=dict)
    #: The LoRA adapters by name (L{llmgw.control.core.adapters}).
    adapters: Mapping[str, Adapter] = field(default_factory=dict)
    port_range: tuple[int, int] = DEFAULT_PORT_RANGE
    path: str | None = None
    #: Each deployment's table as written, by model (what the console
    #: edits); not part of what makes two catalogs equal.
    entries: Mapping[str, Mapping[str, Any]] = field(default_factory=dict, compare=False)

    def routing_policies(self) -> dict[str, str]:
        """
        The routing policy of every deployment that names one, by model:
        what the control plane publishes in its routing table
        (L{llmgw.routing.RoutingTable.set_policies}).
        """
        return {m: d.routing for m, d in sorted(self.deployments.items()) if d.routing is not None}

    def queue_limits(self) -> dict[str, QueueLimits]:
        """
        The admission queue limits of every deployment that sets either,
        by model: published in the routing table with the policies
        (L{llmgw.routing.RoutingTable.set_queue_limits}).
        """
        return {
            m: QueueLimits(d.queue_depth, d.queue_timeout_s)
            for m, d in sorted(self.deployments.items())
            if d.queue_depth is not None or d.queue_timeout_s is not None
        }

    def resume_off(self) -> frozenset[str]:
        """
        The models whose deployments set C{resume_streams = false}.
        """
        return frozenset(m for m, d in self.deployments.items() if not d.resume_streams)

    def adapter_bases(self) -> dict[str, str]:
        """
        Adapter name -> its base's model, for the routing table.
        """
        return {a.name: a.base for _, a in sorted(self.adapters.items())}

    def profile_for(self, model: str) -> Profile | None:
        dep = self.deployments.get(model)
        return self.profiles.get(dep.profile) if dep is not None else None


EMPTY = Catalog()

_PROFILE_FIELDS: dict[str, type | tuple[type, ...]] = {
    "shards": int,
    "gpus_per_shard": int,
    "gpu_memory_mb": int,
    "fabric": str,
    "command": list,
    "env": dict,
    "health_path": str,
    "startup_timeout_s": int,
    "drain_timeout_s": int,
    "stop_grace_s": int,
    "stall_after_s": (int, float),
    "engine": str,
    "worker_command": list,
    "worker_health_path": str,
    "metrics_path": str,
    "metric_names": dict,
    "stop_signal": str,
    "program": str,
    "gpu_types": list,
    "prefer_gpu_types": list,
    "max_loras": int,
    mpx.PROFILE_FIELD: int,
}
_DEPLOYMENT_FIELDS: dict[str, type | tuple[type, ...]] = {
    "model": str,
    "profile": str,
    "replicas": int,
    "routing": str,
    "queue_depth": int,
    "queue_timeout_s": (int, float),
    "min_replicas": int,
    "max_replicas": int,
    "target_in_flight": (int, float),
    "target_waiting": (int, float),
    "scale_to_zero_after_s": (int, float),
    "stabilization_s": (int, float),
    "source": str,
    "file": str,
    "sha256": str,
    "args": list,
    "prefetch": int,
    "max_surge": int,
    "max_unavailable": int,
    "resume_streams": bool,
    "variants": list,
    **mpx.FIELDS,
}
_TYPE_NAMES: dict[Any, str] = {int: "an integer", str: "a string", list: "a list", dict: "a table",
                               (int, float): "a number", bool: "true or false"}


def _check_type(where: str, name: str, value: Any, kind: Any) -> None:
    # bool is an int in Python; a TOML true is never a count.
    if kind is bool and isinstance(value, bool):
        return
    if isinstance(value, bool) or not isinstance(value, kind):
        raise CatalogError(f"{where}: field {name!r} must be {_TYPE_NAMES[kind]}, not {value!r}")


def check_placeholders(where: str, name: str, text: str) -> None:
    """
    @raise CatalogError: C{text} holds a placeholder that is not one of
        L{PLACEHOLDERS}.
    """
    for m in _PLACEHOLDER.finditer(text):
        if m.group(1) not in PLACEHOLDERS:
            known = ", ".join("{" + p + "}" for p in sorted(PLACEHOLDERS))
            raise CatalogError(
                f"{where}: field {name!r} has unknown placeholder {m.group(0)!r} "
                f"(known: {known})"
            )


def fill(text: str, values: Mapping[str, str]) -> str:
    """
    Replace the placeholders in C{text} that C{values} names; the others
    (C{{python}}, for the agent) stay as written.
    """
    return _PLACEHOLDER.sub(lambda m: values.get(m.group(1), m.group(0)), text)


def parse_profile(name: str, raw: Any) -> Profile:
    where = f"profile {name!r}"
    if not isinstance(raw, dict):
        raise CatalogError(f"{where}: must be a table")
    for key, value in raw.items():
        if key not in _PROFILE_FIELDS:
            raise CatalogError(
                f"{where}: unknown field {key!r} (known: {', '.join(sorted(_PROFILE_FIELDS))})"
            )
        _check_type(where, key, value, _PROFILE_FIELDS[key])
    engine_name = raw.get("engine", "generic")
    if engine_name not in engines.ENGINES:
        raise CatalogError(
            f"{where}: field 'engine' names {engine_name!r}, which is not an engine "
            f"(known: {', '.join(engines.known_engines())})"
        )
    engine = engines.ENGINES[engine_name]
    command = raw.get("command", [])
    _check_command_or_engine(where, raw, engine_name)
    for arg in command:
        check_placeholders(where, "command", arg)
    worker_command = raw.get("worker_command", [])
    if not all(isinstance(a, str) for a in worker_command) or ("worker_command" in raw and not worker_command):
        raise CatalogError(f"{where}: field 'worker_command' must be a non-empty list of strings")
    for arg in worker_command:
        check_placeholders(where, "worker_command", arg)
    try:
        metric_names = engines.check_metric_names(f"{where}: field 'metric_names'", raw.get("metric_names", {}))
    except ValueError as e:
        raise CatalogError(str(e)) from None
    stop_signal = raw.get("stop_signal", engine.stop_signal)
    if stop_signal not in engines.STOP_SIGNALS:
        raise CatalogError(
            f"{where}: field 'stop_signal' must be one of {', '.join(sorted(engines.STOP_SIGNALS))}, "
            f"not {stop_signal!r}"
        )
    # The engine's defaults for what the profile leaves out.
    defaults = {
        "health_path": engine.health_path,
        "metrics_path": engine.metrics_path,
        "stop_grace_s": engine.stop_grace_s,
        "startup_timeout_s": engine.startup_timeout_s,
    }
    raw = {**defaults, **raw}
    metrics_path = raw["metrics_path"]
    if metrics_path and not metrics_path.startswith("/"):
        raise CatalogError(f"{where}: field 'metrics_path' must start with '/' (or be \"\" for none), not {metrics_path!r}")
    worker_health = raw.get("worker_health_path", "")
    if worker_health and not worker_health.startswith("/"):
        raise CatalogError(
            f"{where}: field 'worker_health_path' must start with '/' (or be \"\": ready while "
            f"the process lives), not {worker_health!r}"
        )
    env = raw.get("env", {})
    for k, v in env.items():
        if not isinstance(v, str):
            raise CatalogError(f"{where}: field 'env' value of {k!r} must be a string, not {v!r}")
        check_placeholders(where, f"env.{k}", v)
    try:
        types = {k: gputypes.check_types(where, k, raw[k]) for k in ("gpu_types", "prefer_gpu_types") if k in raw}
    except ValueError as e:
        raise CatalogError(str(e)) from None
    raw = {**raw, **types}
    profile = Profile(
        name=name, command=tuple(command), env=dict(env), worker_command=tuple(worker_command),
        metric_names=engines.metric_names_for(engine_name, metric_names) if metrics_path else {},
        stop_signal=stop_signal,
        **{k: v for k, v in raw.items()
           if k not in ("command", "env", "worker_command", "metric_names", "stop_signal")},
    )
    _positive(where, "shards", profile.shards)
    _positive(where, "gpus_per_shard", profile.gpus_per_shard)
    _positive(where, "gpu_memory_mb", profile.gpu_memory_mb, 0)
    _positive(where, "startup_timeout_s", profile.startup_timeout_s)
    _positive(where, "drain_timeout_s", profile.drain_timeout_s, 0)
    _positive(where, "stop_grace_s", profile.stop_grace_s, 0)
    _positive(where, "max_loras", profile.max_loras, 0)
    if not (math.isfinite(profile.stall_after_s) and profile.stall_after_s >= 0):
        raise CatalogError(f"{where}: field 'stall_after_s' must be 0 (off) or more seconds, "
                           f"not {profile.stall_after_s}")
    try:
        mpx.check_profile(where, engine_name, profile.sleep_level)
    except ValueError as e:
        raise CatalogError(str(e)) from None
    if profile.shards > 1 and not profile.fabric:
        raise CatalogError(
            f"{where}: field 'fabric' is required when shards > 1 "
            f"(its {profile.shards} shards must share an interconnect)"
        )
    if profile.health_path and not profile.health_path.startswith("/"):
        raise CatalogError(
            f"{where}: field 'health_path' must start with '/' (or be \"\": ready while the "
            f"process lives), not {profile.health_path!r}"
        )
    return profile


def _check_command_or_engine(where: str, raw: Mapping[str, Any], engine: str) -> None:
    """
    A profile has a C{command}, or an engine whose command llmgw writes
    (for one shard a replica); C{program} only with the latter.

    @raise CatalogError: neither, or C{program} or C{shards} that do not fit.
    """
    launchable = ", ".join(repr(e) for e in engineargv.LAUNCHABLE)
    if "command" in raw:
        command = raw["command"]
        if not command or not all(isinstance(a, str) for a in command):
            raise CatalogError(f"{where}: field 'command' must be a non-empty list of strings")
        if "program" in raw:
            raise CatalogError(
                f"{where}: field 'program' names the executable of a command llmgw writes; "
                "this profile has its own 'command' (put the program in it)"
            )
        return
    if engine not in engineargv.LAUNCHABLE:
        raise CatalogError(
            f"{where}: field 'command' is required (or an 'engine' whose command llmgw "
            f"writes from a deployment's 'source': {launchable})"
        )
    if "program" in raw:
        if not raw["program"].strip():
            raise CatalogError(f"{where}: field 'program' must name an executable, not {raw['program']!r}")
        check_placeholders(where, "program", raw["program"])
    if raw.get("shards", 1) > 1:
        raise CatalogError(
            f"{where}: field 'command' is required when shards > 1: llmgw writes command "
            "lines for one shard a replica (write 'command' and 'worker_command')"
        )


def parse_source_fields(where: str, raw: Mapping[str, Any], profile: Profile) -> ModelSource | None:
    """
    A type-checked deployment entry's C{source} (with C{file} and
    C{sha256}), checked against its C{profile}: C{None} when it names none.

    @raise CatalogError: the source is malformed, or does not fit the
        profile (no engine llmgw launches, a C{command} of its own, a
        llama.cpp engine given a whole repository), or C{file}, C{sha256}
        or C{args} come without a source, or the profile needs one.
    """
    if "source" not in raw:
        for key in ("file", "sha256", "args"):
            if key in raw:
                raise CatalogError(f"{where}: field {key!r} applies only with a 'source'")
        if not profile.command:
            raise CatalogError(
                f"{where}: field 'source' is required: profile {profile.name!r} has no "
                "'command', so llmgw writes one, and it serves the weights the source names"
            )
        return None
    try:
        source = parse_source(raw["source"], file=raw.get("file", ""), sha256=raw.get("sha256", ""))
    except SourceError as e:
        raise CatalogError(f"{where}: field {e.field!r}: {e}") from None
    if profile.engine not in engineargv.LAUNCHABLE:
        raise CatalogError(
            f"{where}: field 'source' needs an engine llmgw can launch, but profile "
            f"{profile.name!r} has engine {profile.engine!r} (set engine = one of "
            f"{', '.join(repr(e) for e in engineargv.LAUNCHABLE)} in the profile)"
        )
    if profile.command:
        raise CatalogError(
            f"{where}: field 'source': profile {profile.name!r} has its own 'command', which "
            "would not serve these weights; drop the profile's command (llmgw writes it) "
            "or the deployment's source"
        )
    if profile.engine == "llamacpp" and source.scheme == "hf" and not source.file:
        raise CatalogError(
            f"{where}: field 'file' is required: llama.cpp loads one GGUF file, so an hf "
            "source for engine 'llamacpp' names it (file = \"NAME.gguf\")"
        )
    args = raw.get("args", [])
    if not all(isinstance(a, str) for a in args):
        raise CatalogError(f"{where}: field 'args' must be a list of strings, not {args!r}")
    for arg in args:
        for m in _ARGS_PLACEHOLDER.finditer(arg):
            if m.group(1) not in ARGS_PLACEHOLDERS:
                known = ", ".join("{" + p + "}" for p in sorted(ARGS_PLACEHOLDERS))
                raise CatalogError(
                    f"{where}: field 'args' has unknown placeholder {m.group(0)!r} (known: {known})"
                )
    return source


def parse_deployment(index: int, raw: Any, profiles: Mapping[str, Profile]) -> Deployment:
    where = f"deployments[{index}]"
    if not isinstance(raw, dict):
        raise CatalogError(f"{where}: must be a table")
    if isinstance(raw.get("model"), str) and raw["model"]:
        where = f"deployment {raw['model']!r}"
    for key, value in raw.items():
        if key not in _DEPLOYMENT_FIELDS:
            raise CatalogError(
                f"{where}: unknown field {key!r} (known: {', '.join(sorted(_DEPLOYMENT_FIELDS))})"
            )
        _check_type(where, key, value, _DEPLOYMENT_FIELDS[key])
    if not raw.get("model"):
        raise CatalogError(f"{where}: field 'model' is required")
    variants = parse_variant_fields(where, raw, profiles)
    profile = variants[0].profile if variants else raw["profile"]
    source = parse_source_fields(where, raw, profiles[profile])
    for v in variants[1:]:
        parse_source_fields(f"{where}: variant {v.profile!r}", raw, profiles[v.profile])
    replicas = raw.get("replicas", 1)
    _positive(where, "replicas", replicas, 0)
    routing = raw.get("routing")
    if routing is not None and routing not in POLICIES:
        raise CatalogError(
            f"{where}: field 'routing' is {routing!r}, which is not a routing policy "
            f"(known: {', '.join(POLICIES)})"
        )
    autoscale = parse_autoscale(where, raw)
    if autoscale is not None:
        replicas = autoscale.min_replicas
    queue_depth = raw.get("queue_depth")
    if queue_depth is not None:
        _positive(where, "queue_depth", queue_depth, 0)
    prefetch = raw.get("prefetch", 0)
    _positive(where, "prefetch", prefetch, 0)
    if prefetch and source is None:
        raise CatalogError(f"{where}: field 'prefetch' needs a 'source' (the weights to keep)")
    queue_timeout = raw.get("queue_timeout_s")
    if queue_timeout is not None:
        try:
            QueueLimits(timeout_s=float(queue_timeout))
        except ValueError as e:
            raise CatalogError(f"{where}: field 'queue_timeout_s': {e}") from None
        queue_timeout = float(queue_timeout)
    for key in ("max_surge", "max_unavailable"):
        if key in raw:
            _positive(where, key, raw[key], 0)
    if raw.get("max_surge", 1) == 0 and raw.get("max_unavailable", 1) == 0:
        raise CatalogError(f"{where}: fields 'max_surge' and 'max_unavailable' cannot both be 0 "
                           "(a rollout could never replace a replica)")
    try:
        rules = mpx.parse(where, raw, [profiles[p].sleep_level for p in (v.profile for v in variants)]
                                or [profiles[profile].sleep_level],
                                autoscale.scale_to_zero_after_s if autoscale and not autoscale.min_replicas else None)
    except ValueError as e:
        raise CatalogError(str(e)) from None
    return Deployment(model=raw["model"], profile=profile, replicas=replicas, routing=routing, variants=variants,
                      multiplex=rules,
                      autoscale=autoscale, queue_depth=queue_depth, queue_timeout_s=queue_timeout,
                      source=source, args=tuple(raw.get("args", ())), prefetch=prefetch,
                      max_surge=raw.get("max_surge"), max_unavailable=raw.get("max_unavailable"),
                      resume_streams=raw.get("resume_streams", True))


def parse_catalog(data: Mapping[str, Any], path: str | None = None) -> Catalog:
    """
    Validate a decoded TOML document.

    @raise CatalogError: anything is wrong; the message names the entry and
        the field.
    """
    known = {"profiles", "deployments", "adapters", "ports"}
    for key in data:
        if key not in known:
            raise CatalogError(f"catalog: unknown top-level entry {key!r} (known: {', '.join(sorted(known))})")
    raw_profiles = data.get("profiles", {})
    if not isinstance(raw_profiles, dict):
        raise CatalogError("catalog: 'profiles' must be a table of tables ([profiles.NAME])")
    profiles = {name: parse_profile(name, raw) for name, raw in raw_profiles.items()}
    raw_deps = data.get("deployments", [])
    if not isinstance(raw_deps, list):
        raise CatalogError("catalog: 'deployments' must be an array of tables ([[deployments]])")
    deployments: dict[str, Deployment] = {}
    for i, raw in enumerate(raw_deps):
        dep = parse_deployment(i, raw, profiles)
        if dep.model in deployments:
            raise CatalogError(f"deployment {dep.model!r}: field 'model' is declared twice")
        deployments[dep.model] = dep
    adapters = parse_adapters(data.get("adapters", []), deployments, profiles)
    deployments = with_fixed_adapters(deployments, adapters, profiles)
    port_range = DEFAULT_PORT_RANGE
    ports = data.get("ports", {})
    if not isinstance(ports, dict):
        raise CatalogError("catalog: 'ports' must be a table")
    for key, value in ports.items():
        if key not in ("first", "last"):
            raise CatalogError(f"ports: unknown field {key!r} (known: first, last)")
        _check_type("ports", key, value, int)
    first, last = ports.get("first", port_range[0]), ports.get("last", port_range[1])
    if not 1 <= first <= last <= 65535:
        raise CatalogError(f"ports: fields 'first' and 'last' must satisfy 1 <= first <= last <= 65535, not {first}..{last}")
    entries = {d["model"]: d for d in raw_deps}
    return Catalog(profiles=profiles, deployments=deployments, adapters=adapters, port_range=(first, last),
                   path=path, entries=entries)


def load_catalog(path: str | os.PathLike[str]) -> Catalog:
    """
    Read and validate the catalog at C{path}.

    @raise CatalogError: it cannot be read, is not TOML, or is invalid.
    """
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise CatalogError(f"catalog {str(p)!r} cannot be read: {e.strerror or e}") from e
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise CatalogError(f"catalog {str(p)!r} is not valid TOML: {e}") from e
    try:
        return parse_catalog(data, path=str(p))
    except CatalogError as e:
        raise CatalogError(f"catalog {str(p)!r}: {e}") from None


def diff(old: Catalog, new: Catalog) -> dict[str, list[str]]:
    """
    What changed between two catalogs, by model and profile name.
    """
    changed_profiles = sorted(
        n for n in set(old.profiles) & set(new.profiles) if old.profiles[n] != new.profiles[n]
    )
    return {
        "added": sorted(set(new.deployments) - set(old.deployments)),
        "removed": sorted(set(old.deployments) - set(new.deployments)),
        "changed": sorted(
            m
            for m in set(old.deployments) & set(new.deployments)
            if old.deployments[m] != new.deployments[m]
            or any(p in changed_profiles for p in new.deployments[m].profile_names)
        ),
        "profiles_added": sorted(set(new.profiles) - set(old.profiles)),
        "profiles_removed": sorted(set(old.profiles) - set(new.profiles)),
        "profiles_changed": changed_profiles,
    }
