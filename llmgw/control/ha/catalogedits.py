"""
A change to the catalog kept in etcd, made by the leader for its admin API
(the console's deploy, change and delete).

The write is the compare-and-swap C{llmgw ctl catalog apply} makes (the
leader key still held by this leader's lease), and more: the catalog key
must still be at the revision the change was computed from, so two changes
made at once never lose one another (the second is refused: try again).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from twisted.internet import defer

from llmgw.control.core.catalog import CatalogError, diff
from llmgw.control.core.catalogedit import Edited
from llmgw.control.ha.election import leader_key
from llmgw.control.state.interfaces import AdminError
from llmgw.etcd import Compare, EtcdError, Put


def refused(status: int, message: str) -> AdminError:
    """An L{AdminError} the admin API answers with C{status}."""
    error = AdminError(message)
    error.status = status  # type: ignore[attr-defined]
    return error


async def store_edit(store: Any, prefix: str, key: bytes, lease: int,
                     change: Callable[[bytes, str], Edited]) -> tuple[Edited, int]:
    """
    Read the catalog at C{key}, apply C{change} to its text, and store the
    result under C{lease} if neither the leader nor the catalog changed
    meanwhile. Returns what was stored and its revision.

    @raise AdminError: 400, the change is refused (the catalog's own
        message); 409, the leader or the catalog changed meanwhile; 503,
        etcd could not be asked.
    """
    try:
        kv = await defer.ensureDeferred(store.get(key))
    except EtcdError as e:
        raise refused(409, f"etcd cannot be asked for the catalog ({e}); nothing was changed") from None
    where = f"in etcd {key.decode()}" + (f" (revision {kv.mod_revision})" if kv is not None else "")
    try:
        edited = change(kv.value if kv is not None else b"", where)
    except CatalogError as e:
        raise refused(400, str(e)) from None
    same = Compare.mod_revision(key, kv.mod_revision) if kv is not None else Compare.absent(key)
    try:
        result = await defer.ensureDeferred(store.txn(
            [Compare.held_by(leader_key(prefix), lease), same], [Put(key, edited.text)]))
    except EtcdError as e:
        raise refused(409, f"etcd cannot store the catalog ({e}); nothing was changed") from None
    if not result.succeeded:
        raise refused(409, "the catalog in etcd or its leader changed while this change was made: "
                            "nothing was stored; try again")
    return edited, result.revision


async def edit(member: Any, key: bytes, change: Callable[[bytes, str], Edited]) -> dict[str, Any]:
    """
    As the leading C{member} (an L{llmgw.control.ha.member.HAMember}):
    L{store_edit}, then run the catalog stored, unless the catalog watch
    already did. Returns where it was stored and what changed.

    @raise AdminError: as L{store_edit}; 409, this member does not lead
        or has not yet taken over.
    """
    if not member.taken_over or not member.election.may_command():
        raise refused(409, "this control-plane member does not lead (or has only just won): try again")
    before = member.reconciler.catalog
    edited, revision = await store_edit(member.store, member.prefix, key, member.election.lease, change)
    if revision > member.catalog_revision:
        member.reconciler.apply_catalog(edited.catalog)
        member.catalog_revision = revision
    return {"stored": f"etcd {key.decode()} (revision {revision})", "changes": diff(before, edited.catalog)}
