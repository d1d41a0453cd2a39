"""
Command-line options shared by every C{twistd llmgw} sub-command: typed
parameters whose coercion lives in L{usage.Options} (a coerce function per
option), errors that name the option, renamed options that keep their old
name for a release (L{Options.aliases}), C{--version}, and the option rows
and checks that several sub-commands share (listen addresses, certificates,
API keys, backlog and connection caps).
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

from twisted.python import usage

from llmgw.addresses import AddressError, parse_address

#: What an old option name's warning says; C{old} and C{new} without dashes.
RENAMED = "--{old} is now --{new}; --{old} will be removed in the next release"


def renamed_warning(old: str, new: str) -> str:
    """
    The one line an old option name warns with.
    """
    return RENAMED.format(old=old, new=new)


def version_text() -> str:
    """
    llmgw's version and the Twisted it runs on, as C{--version} prints them.
    """
    import llmgw
    import twisted

    return f"llmgw {llmgw.__version__} (Twisted {twisted.__version__})"


class _NamedCoerce(usage.CoerceParameter):
    """
    Like L{usage.CoerceParameter}, but a refused value's error starts with
    the option's name (C{--poll-interval: ...}) instead of "Parameter type
    enforcement failed".
    """

    def dispatch(self, parameterName: str, value: Any) -> None:
        if value is None:
            raise usage.UsageError(f"--{parameterName} requires an argument")
        try:
            coerced = self.coerce(value)
        except (TypeError, ValueError) as e:
            raise usage.UsageError(f"--{parameterName}: {e}") from None
        self.options.opts[parameterName] = coerced


class Options(usage.Options):
    """
    L{usage.Options} whose typed parameters (a coerce function in the fifth
    place of C{optParameters}) refuse bad values with the option named.
    Defaults are written already typed (Twisted does not coerce them).

    C{aliases} maps an old long name to its new one: the old name works
    exactly as the new one and adds L{renamed_warning} to C{warnings}
    (once), which the sub-command's C{makeService} logs. Help texts are
    one paragraph each, whatever the indentation of the source they came
    from. C{--version} prints L{version_text} and exits.
    """

    #: Old long name -> new long name, for options renamed in this release.
    aliases: ClassVar[dict[str, str]] = {}

    def __init__(self) -> None:
        super().__init__()
        #: Warnings about the command line (an old option name), for the log.
        self.warnings: list[str] = []
        for name, d in list(self._dispatch.items()):
            if type(d) is usage.CoerceParameter:
                self._dispatch[name] = _NamedCoerce(self, d.coerce)
        for old, new in self.aliases.items():
            self._add_alias(old, new)
        # Docstrings of opt_ methods keep their source indentation; help
        # wraps each text as one paragraph.
        for name, doc in self.docs.items():
            if doc:
                self.docs[name] = " ".join(doc.split())

    def _add_alias(self, old: str, new: str) -> None:
        target = self.synonyms[new]
        takes_value = f"{target}=" in self.longOpt
        self.longOpt.append(old + ("=" if takes_value else ""))
        self.synonyms[old] = old
        self.docs[old] = f"old name of --{new}: works the same, warns; removed in the next release"

        def dispatch(name: str, value: Any = None) -> None:
            self.warn_renamed(old, new)
            handler = self._dispatch[target]
            if isinstance(handler, usage.CoerceParameter):
                handler.dispatch(target, value)
            else:
                handler(target, value)

        self._dispatch[old] = dispatch

    def warn_renamed(self, old: str, new: str) -> None:
        """
        Note, once, that option C{--old} was given under its old name.
        """
        warning = renamed_warning(old, new)
        if warning not in self.warnings:
            self.warnings.append(warning)

    def canonical(self, name: str) -> str | None:
        """
        The long name of the option C{name} (dashes or underscores, an old
        name or a new one) stands for, or C{None} if there is none. An old
        name is noted as L{warn_renamed} does.
        """
        for spelled in (name, name.replace("_", "-")):
            if spelled in self.aliases:
                new = self.aliases[spelled]
                self.warn_renamed(spelled, new)
                return self.synonyms[new]
            if spelled in self.synonyms:
                return self.synonyms[spelled]
        return None

    def set_option(self, name: str, value: Any) -> None:
        """
        Set option C{name} (its long name, or an old name) from C{value} as
        if it had been given on the command line: coerced and checked the
        same way.

        @raise usage.UsageError: the value is refused.
        """
        name = self.canonical(name) or name
        dispatch = self._dispatch[name]
        if isinstance(dispatch, usage.CoerceParameter):
            dispatch.dispatch(name, value)
        else:
            dispatch(name, value)

    def opt_version(self) -> None:
        """
        Print llmgw's version and Twisted's, and exit.
        """
        print(version_text())
        sys.exit(0)


def log_warnings(options: usage.Options, log: Any) -> None:
    """
    Log each of C{options}' warnings (old option names, ...) once, as
    C{makeService} does.
    """
    for warning in getattr(options, "warnings", []):
        log.warn("{problem}", problem=warning)


def _number(kind: type, value: Any) -> float:
    text = str(value).strip()
    try:
        n = kind(text)
    except ValueError:
        what = "a number" if kind is float else "a whole number"
        raise ValueError(f"{text!r} is not {what}") from None
    if kind is float and not math.isfinite(n):
        raise ValueError(f"{text!r} is not a finite number")
    return n  # type: ignore[no-any-return]


def _coercer(kind: type, minimum: float, strict: bool, doc: str) -> Callable[[Any], Any]:
    def coerce(value: Any) -> Any:
        n = _number(kind, value)
        if n < minimum or (strict and n == minimum):
            raise ValueError(f"must be {doc.lower().rstrip('.')}, not {n}")
        return n

    coerce.coerceDoc = doc  # type: ignore[attr-defined]
    return coerce


_SIZE = re.compile(r"^(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1000, "M": 1000**2, "G": 1000**3, "T": 1000**4}


def byte_size(value: Any) -> int:
    """
    A size in bytes, 0 or more: a whole number, or a number with a unit, as
    in C{20GiB}, C{512MiB}, C{1.5TB} (KiB, MiB, GiB, TiB are powers of 1024;
    K, M, G, T with or without B powers of 1000). What 0 means is the
    option's to say (often: no limit).

    @raise ValueError: anything else, naming the value.
    """
    text = str(value).strip()
    m = _SIZE.match(text)
    if m is None:
        raise ValueError(f"{text!r} is not a size (a number of bytes, or one like 20GiB or 500MB)")
    number, unit = m.group(1), (m.group(2) or "").upper()
    scale = 1024 ** " KMGT".index(unit[0]) if "I" in unit else _UNITS[unit[:1]]
    return int(float(number) * scale)


byte_size.coerceDoc = "Bytes, or a size like 20GiB or 500MB."  # type: ignore[attr-defined]

#: Coerce functions for C{optParameters}.
positive_float = _coercer(float, 0, True, "A positive number.")
non_negative_float = _coercer(float, 0, False, "A number, 0 or more.")
positive_int = _coercer(int, 0, True, "A positive whole number.")
non_negative_int = _coercer(int, 0, False, "A whole number, 0 or more.")



# -- rows several sub-commands share ---------------------------------------------------
#
# One spelling of each shared option, so that a name means one thing on
# every command.

HOSTS_DOC = (
    "comma-separated Host names {what} answers to besides loopback names and its bound "
    "address (NAME, NAME:PORT, .DOMAIN, or * for any); a wildcard bind needs them"
)


def certs_row(default: str | None, doc: str) -> list[Any]:
    """
    C{--certs DIR}: the certificates directory.
    """
    return ["certs", None, default, doc]


def heartbeat_row(default: float, doc: str) -> list[Any]:
    """
    C{--heartbeat SECONDS}: the agents' heartbeat interval.
    """
    return ["heartbeat", None, default, doc, positive_float]


def api_keys_row(what: str) -> list[Any]:
    """
    C{--api-keys FILE}: the gateway's API keys.
    """
    return ["api-keys", None, None,
            f"{what} (one per line, or TOML [keys] name = \"key\" and [keys.NAME] tables with "
            "limits); none: no keys"]


def limit_share_row(doc: str) -> list[Any]:
    """
    C{--limit-share}: the share of each API key's limits a gateway enforces.
    """
    return ["limit-share", None, 1.0, doc, positive_float]


def gateway_hosts_row() -> list[Any]:
    """
    C{--gateway-hosts}: Host names the gateway answers to.
    """
    return ["gateway-hosts", None, "", HOSTS_DOC.format(what="the gateway")]


def backlog_row(default: int, doc: str) -> list[Any]:
    """
    C{--backlog N}: a listening port's backlog.
    """
    return ["backlog", None, default, doc, positive_int]


def max_connections_row(default: int, doc: str) -> list[Any]:
    """
    C{--max-connections N}: most connections at once on a port (0: no cap).
    """
    return ["max-connections", None, default, doc, non_negative_int]


def queue_bytes_rows(name: str, per_model: int, total: int) -> list[list[Any]]:
    """
    C{--NAME-per-model} and C{--NAME}: the bytes of request bodies that may
    wait in the gateway's admission queue, per model and in all.
    """
    return [
        [f"{name}-per-model", None, per_model,
         f"bytes of request bodies that may wait per model when no replica can take them (default "
         f"{per_model >> 20} MiB); a body that would pass it gets 503 and Retry-After at once",
         byte_size],
        [name, None, total,
         f"bytes of request bodies that may wait, all models together (default {total >> 20} MiB); a "
         "body that would pass it gets 503 and Retry-After at once", byte_size],
    ]


def memory_limit_row(name: str, what: str) -> list[Any]:
    """
    C{--NAME BYTES}: the memory ceiling of C{what} (L{llmgw.memceiling}).
    """
    return [name, None, 0,
            f"memory ceiling of {what} (bytes, or 512MiB, 2GiB): from 90% of it in resident memory "
            "new gateway requests get 503 and Retry-After, until under 80%; Linux only (0: none)",
            byte_size]


def model_cache_rows(where: str) -> list[list[Any]]:
    """
    C{--model-cache DIR} and C{--model-cache-size BYTES}: where an agent
    keeps the weights it fetches, and at most how much.
    """
    return [
        ["model-cache", None, None, f"directory of the node's model cache (default: {where})"],
        ["model-cache-size", None, None, "most bytes the model cache holds, like 200GiB "
         "(default: what it holds at start plus the free space of its filesystem, less 5% of "
         "that filesystem's size)", byte_size],
    ]


# -- checks several sub-commands share --------------------------------------------------


def listen_address(
    options: usage.Options, name: str, default_host: str, off: bool = False
) -> tuple[str, int] | None:
    """
    Option C{name}'s C{[HOST:]PORT} as (host, port), C{default_host} when
    no host is given; C{None} for C{off} where C{off} is allowed.

    @raise usage.UsageError: naming the option and what is wrong.
    """
    value = str(options[name]).strip()
    if off and value.lower() in ("off", "none", ""):
        return None
    try:
        return parse_address(value, default_host)
    except AddressError as e:
        raise usage.UsageError(f"--{name}: {e}") from e


def host_list(options: usage.Options, name: str) -> None:
    """
    Replace option C{name}'s comma-separated Host names with their parsed
    list (L{llmgw.hostcheck.parse_hosts}).

    @raise usage.UsageError: naming the option and the bad entry.
    """
    from llmgw.hostcheck import HostListError, parse_hosts

    try:
        options[name] = parse_hosts(options[name] or "")
    except HostListError as e:
        raise usage.UsageError(f"--{name}: {e}") from e


def memory_limit(options: usage.Options, name: str) -> None:
    """
    Check that option C{name}'s memory ceiling, when set, can work here.

    @raise usage.UsageError: naming the option and what is missing.
    """
    from llmgw.memceiling import MemoryCeilingError, check_readable

    if options[name]:
        try:
            check_readable()
        except MemoryCeilingError as e:
            raise usage.UsageError(f"--{name}: {e}") from e


def api_keys(options: usage.Options) -> None:
    """
    Check C{--limit-share} and load C{--api-keys} into C{keyring} (C{None}
    without a file).

    @raise usage.UsageError: naming the option and what is wrong.
    """
    from llmgw.gateway.keys import KeysError, load_keys

    if options["limit-share"] > 1:
        raise usage.UsageError(f"--limit-share: {options['limit-share']} is over 1")
    options["keyring"] = None
    if options["api-keys"]:
        try:
            options["keyring"] = load_keys(Path(options["api-keys"]))
        except KeysError as e:
            raise usage.UsageError(f"--api-keys: {e}") from e


# -- the same for argparse (llmgw ctl) ----------------------------------------------------


class _OldName(argparse.Action):
    """
    An old option name in argparse: stores into the new option's C{dest}
    as the new one would, and warns once on stderr.
    """

    def __init__(self, option_strings: list[str], dest: str, new: str = "", **kwargs: Any):
        super().__init__(option_strings, dest, **kwargs)
        self.new = new
        self.warned = False

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        if not self.warned:
            self.warned = True
            old = (option_string or self.option_strings[0]).lstrip("-")
            sys.stderr.write(f"{parser.prog}: {renamed_warning(old, self.new)}\n")
        setattr(namespace, self.dest, values)


def add_old_name(parser: argparse.ArgumentParser, old: str, new: str, dest: str, **kwargs: Any) -> None:
    """
    Add C{--old} to C{parser}: it works as C{--new} (give the same C{dest},
    C{type} and C{metavar}) and warns once, with L{renamed_warning}.
    """
    parser.add_argument(
        f"--{old}", dest=dest, action=_OldName, new=new, default=argparse.SUPPRESS,
        help=f"old name of --{new}: works the same, warns; removed in the next release", **kwargs,
    )
