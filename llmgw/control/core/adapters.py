"""
The catalog's LoRA adapters (DESIGN §22): C{[[adapters]]} entries, each
bound to a base deployment and asked for by its own name.

Where the base's engine loads adapters while it runs (vLLM, with the
profile's C{max_loras}), replicas hold a changing set; where it takes them
only at its start (llama.cpp's server), every replica of the base starts
with all of the base's adapters, in L{fixed_adapters}' order, which is the
order of the ids a request selects them by.

Plain data and pure functions, as the rest of the catalog.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from llmgw.control.core.catalogfields import CatalogError
from llmgw.sourcespec import ModelSource, SourceError, parse_source

if TYPE_CHECKING:
    from llmgw.control.core.catalog import Deployment, Profile

#: Engines whose replicas serve adapters, and how: loaded while it runs
#: ("runtime") or given at its start ("fixed").
ADAPTER_ENGINES: Mapping[str, str] = {"vllm": "runtime", "llamacpp": "fixed"}

_FIELDS: dict[str, type] = {"name": str, "base": str, "source": str, "file": str, "sha256": str}
# A name clients send as "model" and engines take as a LoRA name: no spaces,
# no path separators, nothing a URL or a metric label would need quoting for.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")


@dataclass(frozen=True)
class Adapter:
    """
    One LoRA adapter: asked for as C{name}, served by replicas of the
    deployment whose model is C{base}, its weights from C{source} (through
    the node's model cache, as a deployment's).
    """

    name: str
    base: str
    source: ModelSource


def parse_adapter(index: int, raw: Any) -> Adapter:
    """
    One type-checked C{[[adapters]]} entry, not yet checked against the
    deployments (L{check_adapters} does that).

    @raise CatalogError: a field is unknown, missing or malformed; the
        message names the entry and the field.
    """
    where = f"adapters[{index}]"
    if not isinstance(raw, dict):
        raise CatalogError(f"{where}: must be a table")
    if isinstance(raw.get("name"), str) and raw["name"]:
        where = f"adapter {raw['name']!r}"
    for key, value in raw.items():
        if key not in _FIELDS:
            raise CatalogError(f"{where}: unknown field {key!r} (known: {', '.join(sorted(_FIELDS))})")
        if not isinstance(value, _FIELDS[key]):
            raise CatalogError(f"{where}: field {key!r} must be a string, not {value!r}")
    for key in ("name", "base", "source"):
        if not raw.get(key):
            raise CatalogError(f"{where}: field {key!r} is required")
    if not _NAME.fullmatch(raw["name"]):
        raise CatalogError(
            f"{where}: field 'name' must be 1-128 letters, digits and . _ : - (starting with a "
            f"letter or digit), not {raw['name']!r}"
        )
    try:
        source = parse_source(raw["source"], file=raw.get("file", ""), sha256=raw.get("sha256", ""))
    except SourceError as e:
        raise CatalogError(f"{where}: field {e.field!r}: {e}") from None
    return Adapter(name=raw["name"], base=raw["base"], source=source)


def check_adapters(raw: Any, deployments: Mapping[str, Any], engines: Mapping[str, str]) -> dict[str, Adapter]:
    """
    The catalog's adapters by name, checked against its deployments:
    C{engines} gives each deployment's engine (its profile's), by model.

    @raise CatalogError: C{raw} is not an array of tables, an entry is
        malformed, a name is declared twice or is also a deployment's
        model, a base is no deployment, or a base's engine serves no
        adapters (L{ADAPTER_ENGINES}).
    """
    if not isinstance(raw, list):
        raise CatalogError("catalog: 'adapters' must be an array of tables ([[adapters]])")
    out: dict[str, Adapter] = {}
    for i, entry in enumerate(raw):
        adapter = parse_adapter(i, entry)
        where = f"adapter {adapter.name!r}"
        if adapter.name in out:
            raise CatalogError(f"{where}: field 'name' is declared twice")
        if adapter.name in deployments:
            raise CatalogError(f"{where}: field 'name' is also a deployment's model (a client could not "
                               "say which it means)")
        if adapter.base not in deployments:
            known = ", ".join(sorted(deployments)) or "none"
            raise CatalogError(f"{where}: field 'base' names {adapter.base!r}, which is no deployment's "
                               f"model (deployments: {known})")
        engine = engines.get(adapter.base, "")
        if engine not in ADAPTER_ENGINES:
            raise CatalogError(
                f"{where}: field 'base': deployment {adapter.base!r} runs engine {engine!r}, which "
                f"serves no adapters (engines that do: {', '.join(sorted(ADAPTER_ENGINES))})"
            )
        out[adapter.name] = adapter
    return out


def fixed_adapters(adapters: Mapping[str, Adapter], base: str) -> tuple[Adapter, ...]:
    """
    The adapters every replica of C{base} starts with when its engine
    takes them only at its start: all of C{base}'s, sorted by name, so that
    the position of each (the id a request selects it by) is the same on
    every replica started from the same catalog.
    """
    return tuple(sorted((a for a in adapters.values() if a.base == base), key=lambda a: a.name))


def parse_adapters(raw: Any, deployments: Mapping[str, Deployment],
                   profiles: Mapping[str, Profile]) -> dict[str, Adapter]:
    """
    The catalog's C{adapters} entry (C{raw}), checked against its
    deployments and their profiles (L{check_adapters}); a vLLM base's
    profile must say how many adapters a replica holds (C{max_loras}).

    @raise CatalogError: as L{check_adapters}, or a vLLM base's profile
        sets no C{max_loras}.
    """
    engines = {m: profiles[d.profile].engine for m, d in deployments.items()}
    adapters = check_adapters(raw, deployments, engines)
    for a in adapters.values():
        profile = profiles[deployments[a.base].profile]
        if ADAPTER_ENGINES[profile.engine] == "runtime" and profile.max_loras < 1:
            raise CatalogError(
                f"adapter {a.name!r}: field 'base': deployment {a.base!r} runs on profile "
                f"{profile.name!r}, which sets no 'max_loras' (how many adapters a replica holds "
                "at once; with it, llmgw enables vLLM's runtime LoRA loading)"
            )
    return adapters


def with_fixed_adapters(deployments: Mapping[str, Deployment], adapters: Mapping[str, Adapter],
                        profiles: Mapping[str, Profile]) -> dict[str, Deployment]:
    """
    C{deployments}, those whose engine takes adapters only at its start
    given their adapters (L{fixed_adapters}): a change of that set changes
    what launches the replicas, so it rolls them make-before-break.
    """
    out = dict(deployments)
    for model, dep in deployments.items():
        if ADAPTER_ENGINES.get(profiles[dep.profile].engine) == "fixed":
            fixed = fixed_adapters(adapters, model)
            if fixed:
                out[model] = replace(dep, adapters=fixed)
    return out


#: The environment that lets vLLM load and unload adapters while it runs.
VLLM_RUNTIME_ENV: Mapping[str, str] = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}


def adapter_launch(profile: Profile, deployment: Deployment | None, argv: Sequence[str]
                   ) -> tuple[tuple[str, ...], dict[str, str], tuple[tuple[str, ModelSource], ...]]:
    """
    What adapters change in a shard's launch: its argv, its environment
    and the adapters it starts with (name and source, in id order; the
    agent puts each on the node and adds C{--lora PATH}).

    A vLLM profile with C{max_loras} runs with runtime LoRA updating on
    and C{--enable-lora --max-loras N} (added to a profile's own command
    too, unless it has them); a llama.cpp deployment starts with its
    fixed adapters.
    """
    argv, env = tuple(argv), dict(profile.env)
    fixed: tuple[tuple[str, ModelSource], ...] = ()
    if profile.engine == "vllm" and profile.max_loras > 0:
        env.update(VLLM_RUNTIME_ENV)
        if "--enable-lora" not in argv:
            argv += ("--enable-lora",)
        if "--max-loras" not in argv:
            argv += ("--max-loras", str(profile.max_loras))
    elif profile.engine == "llamacpp" and deployment is not None:
        fixed = tuple((a.name, a.source) for a in deployment.adapters)
    return argv, env, fixed
