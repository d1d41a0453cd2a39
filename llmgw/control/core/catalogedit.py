"""
Changes to one deployment of a catalog's TOML text, made in place: the
console's deploy, change and delete (L{llmgw.control.admin.deploy}).

The new catalog is validated whole by L{parse_catalog}, the code that
reads the file, so an entry the file would refuse is refused with the very
same message. Only the C{[[deployments]]} table of the model changed is
rewritten; the rest of the text (profiles, comments, other deployments,
their layout) is kept byte for byte, and the result is read back to check
it says exactly what was meant before anyone stores it.
"""

from __future__ import annotations

import math
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from llmgw.control.core.catalog import Catalog, CatalogError, parse_catalog

# A table header line: [name] or [[name]], with an optional comment.
_HEADER = re.compile(r"^[ \t]*(\[\[?)[ \t]*([^\]\[#]+?)[ \t]*\]\]?[ \t]*(?:#.*)?$")
_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


@dataclass(frozen=True)
class Edited:
    """
    A catalog's text after one change, and the catalog it reads as.
    """

    text: bytes
    catalog: Catalog


class UneditableCatalog(CatalogError):
    """
    The text is a valid catalog whose deployments are written in a form
    that cannot be changed in place (an inline array, say); nothing was
    changed.
    """


def decode(text: bytes, where: str) -> dict[str, Any]:
    """
    C{text} as TOML.

    @raise CatalogError: it is not UTF-8 TOML; the message names C{where}.
    """
    try:
        return tomllib.loads(text.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise CatalogError(f"catalog {where} is not valid TOML: {e}") from None


def put_deployment(text: bytes, model: str, fields: Mapping[str, Any], where: str) -> Edited:
    """
    C{text} with model C{model}'s deployment set to C{fields} (a table as
    in the file, without C{model}): replaced where it stands, or appended.

    @raise CatalogError: the new catalog is invalid (the message is the
        one L{parse_catalog} gives the same entry in a file), or C{text}
        itself cannot be read or changed in place.
    """
    data = decode(text, where)
    entry = {"model": model, **{k: v for k, v in fields.items() if k != "model"}}
    deployments = list(data.get("deployments", []) if isinstance(data.get("deployments"), list) else [])
    index = _index_of(deployments, model)
    if index is None:
        deployments.append(entry)
    else:
        deployments[index] = entry
    catalog = parse_catalog({**data, "deployments": deployments})
    table = deployment_table(entry)
    lines = text.decode("utf-8").splitlines(keepends=True)
    if index is None:
        head = "".join(lines)
        if head and not head.endswith("\n"):
            head += "\n"
        new = head + ("\n" if head.strip() else "") + table
    else:
        start, end = _block(lines, index)
        new = "".join(lines[:start]) + table + "".join(lines[end:])
    return Edited(_checked(new, {**data, "deployments": deployments}, where), catalog)


def remove_deployment(text: bytes, model: str, where: str) -> Edited:
    """
    C{text} without model C{model}'s deployment (and the comment lines
    right above its table).

    @raise KeyError: the catalog has no such deployment.
    @raise CatalogError: C{text} cannot be read or changed in place, or
        the catalog left would be invalid.
    """
    data = decode(text, where)
    deployments = list(data.get("deployments", []) if isinstance(data.get("deployments"), list) else [])
    index = _index_of(deployments, model)
    if index is None:
        raise KeyError(model)
    del deployments[index]
    rest = {**data, "deployments": deployments}
    catalog = parse_catalog(rest)
    lines = text.decode("utf-8").splitlines(keepends=True)
    start, end = _block(lines, index)
    while start > 0 and lines[start - 1].lstrip().startswith("#"):
        start -= 1
    if end < len(lines) and not lines[end].strip() and (start == 0 or not lines[start - 1].strip()):
        end += 1  # one blank line stays between what was around it
    while end == len(lines) and start > 0 and not lines[start - 1].strip():
        start -= 1  # nor does one stay at the end: an added table's removal restores the text
    new = "".join(lines[:start]) + "".join(lines[end:])
    if not deployments:
        rest.pop("deployments")
    return Edited(_checked(new, rest, where), catalog)


def _index_of(deployments: list[Any], model: str) -> int | None:
    for i, d in enumerate(deployments):
        if isinstance(d, dict) and d.get("model") == model:
            return i
    return None


def _block(lines: list[str], index: int) -> tuple[int, int]:
    """
    The lines of the C{index}th C{[[deployments]]} table: from its header
    to the next table that is not one of its own (C{[[deployments.x]]}),
    less the blank and comment lines before that (they belong to what
    follows).

    @raise UneditableCatalog: there is no such header line.
    """
    seen = -1
    start = None
    for i, line in enumerate(lines):
        m = _HEADER.match(line)
        if m is None:
            continue
        name = m.group(2).replace(" ", "")
        if start is None:
            if m.group(1) == "[[" and name == "deployments":
                seen += 1
                if seen == index:
                    start = i
            continue
        if not name.startswith("deployments.") or (m.group(1) == "[[" and name == "deployments"):
            return start, _trim(lines, start, i)
    if start is None:
        raise UneditableCatalog(
            "the catalog writes its deployments in a form the console cannot change in place "
            "(not as [[deployments]] tables); change it by hand"
        )
    return start, _trim(lines, start, len(lines))


def _trim(lines: list[str], start: int, end: int) -> int:
    while end > start + 1 and (not lines[end - 1].strip() or lines[end - 1].lstrip().startswith("#")):
        end -= 1
    return end


def _checked(text: str, meant: dict[str, Any], where: str) -> bytes:
    """
    C{text} encoded, once it reads back as C{meant}.

    @raise UneditableCatalog: it does not (a table header inside a
        multi-line string, say).
    """
    try:
        raw = text.encode("utf-8")
        back = tomllib.loads(text)
    except (UnicodeEncodeError, tomllib.TOMLDecodeError):
        back = None
    if back != meant:
        raise UneditableCatalog(
            f"the catalog {where} is laid out in a way the console cannot change in place "
            "(its text would not say what was meant); change it by hand"
        )
    return raw


# -- writing TOML -------------------------------------------------------------------------


def deployment_table(entry: Mapping[str, Any]) -> str:
    """
    C{entry} (validated: plain strings, numbers, booleans and lists, a
    variant's inline tables) as a C{[[deployments]]} table, C{model} first.
    """
    out = ["[[deployments]]\n"]
    for key in sorted(entry, key=lambda k: (k != "model", k != "profile", k != "source", k)):
        out.append(f"{_key(key)} = {_value(entry[key])}\n")
    return "".join(out)


def _key(name: str) -> str:
    return name if _BARE_KEY.match(name) else _string(name)


def _string(text: str) -> str:
    out = ['"']
    for c in text:
        if c in '"\\':
            out.append("\\" + c)
        elif ord(c) < 0x20 or ord(c) == 0x7F:
            out.append(f"\\u{ord(c):04x}")
        else:
            out.append(c)
    out.append('"')
    return "".join(out)


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise CatalogError(f"{value!r} is not a finite number")
        return repr(value)
    if isinstance(value, str):
        return _string(value)
    if isinstance(value, list):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_key(k)} = {_value(v)}" for k, v in value.items()) + "}"
    raise CatalogError(f"{value!r} has no TOML form")
