"""
What an operator set through the admin API, kept in etcd for a highly
available control plane (DESIGN §17): scale overrides,
autoscaling bounds, cordoned nodes and nodes being drained, and the
deployments held after a configuration failure. Standalone, the same state
but the holds lives in a file beside the catalog (L{KeptState}).

The document is the file's JSON (L{KeptState.to_data}) under one key,
C{PREFIX/fleet-state}. Every write is a transaction that compares the
leader key's lease with the lease this member won under, and the key's
mod revision with the one this member last read or wrote: a deposed
leader's write, or one racing a write it has not seen, changes nothing.

How a change is applied (etcd first, then the reconciler):

- An operator's change comes through L{SharedFleet}, the admin API's fleet
  in HA mode. It checks the request as the reconciler would, writes the
  new document to etcd, and only once etcd accepted it applies the change
  to the reconciler, whose own call to L{SharedKeptState.set} (and the
  others) then finds the local copy already current and writes nothing.
  The admin handler answers when the write is done; if etcd refuses it
  (this member no longer leads) or cannot be reached, the answer is an
  error and nothing changed, here or in etcd.
- A change the reconciler makes by itself (a node the inventory dropped
  leaves the cordoned and draining sets; a deployment is held after a
  configuration failure, or released when its profile changed) goes
  through L{SharedKeptState.set_nodes} or L{SharedKeptState.set_holds}:
  applied locally at once and written behind, a failure logged (a new
  leader reads what etcd holds).
- An operator's retry (L{SharedFleet.retry}) removes the hold in etcd
  first, like the other admin changes, then releases it in the
  reconciler; a deposed leader's retry changes nothing (409).
- Reads are of the local copy, loaded at each take-over
  (L{SharedKeptState.load_from}); only the leader writes, so while it
  leads its copy is what etcd holds. A change made in etcd by hand is seen
  by a watch (L{SharedKeptState.follow}) and taken up as at a take-over.
  When etcd holds no document yet, the leader seeds it from its own state
  file (the standalone one), under its lease.

Writes from one member are serialised (one transaction at a time), so two
admin requests at once do not refuse each other.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from twisted.internet import defer
from twisted.logger import Logger

from llmgw.control.core import placing, scaler
from llmgw.control.core.failures import Hold
from llmgw.control.core.kept import KeptState
from llmgw.control.ha.election import leader_key
from llmgw.control.state.interfaces import AdminError
from llmgw.etcd import Compare, EtcdError, Put, Range


def fleet_state_key(prefix: str) -> bytes:
    """Where the operator's fleet state lives in etcd."""
    return (prefix.rstrip("/") + "/fleet-state").encode()


class SharedStateError(OSError):
    """
    etcd did not take a write of the fleet state: this member no longer
    leads, or etcd could not be reached. The reconciler treats it as the
    file version's failure to write.
    """


class SharedKeptState(KeptState):
    """
    L{KeptState} whose document lives in etcd; see the module docstring.

    @param store: the etcd client (or L{llmgw.testing.fakeetcd.FakeEtcd}).
    """

    log = Logger()
    keeps_holds = True

    def __init__(self, store: Any, prefix: str):
        super().__init__(None)
        self.store = store
        self.prefix = prefix
        self.key = fleet_state_key(prefix)
        #: Shown in the reconciler's errors ("could not keep ... in ETCD KEY").
        self.path = Path(f"etcd:{self.key.decode()}")
        #: The lease this member leads under; None while it does not.
        self.lease: int | None = None
        #: The key's mod revision as last read or written (0: absent).
        self.revision = 0
        self._lock = defer.DeferredLock()
        #: Writes accepted and refused (status, tests).
        self.writes = self.refused = 0

    def load(self) -> list[str]:
        # The local copy is loaded from etcd at take-over (load_from).
        return []

    def save(self) -> None:
        # Writes go to etcd first (write); the local copy is applied after.
        pass

    def set(self, model: str, replicas: int, catalog_replicas: int) -> None:
        self.overrides[model] = (replicas, catalog_replicas)

    def set_bounds(self, model: str, low: int, high: int, policy: Any) -> None:
        self.bounds[model] = (low, high, policy.min_replicas, policy.max_replicas)

    def set_nodes(self, cordoned: Iterable[str], draining: Iterable[str]) -> bool:
        """
        Keep the cordoned and draining nodes: local at once, written to
        etcd behind (a failure is logged). An operator's cordon or drain has
        written them already (L{SharedFleet}), so nothing is written then.
        """
        cordoned, draining = frozenset(cordoned), frozenset(draining)
        if (cordoned, draining) == (self.cordoned, self.draining):
            return False
        self.cordoned, self.draining = cordoned, draining
        d = self.write(lambda state: state.take_data(self.to_data()))
        d.addErrback(lambda f: self.log.error(
            "cordoned and draining nodes not kept in etcd {key}: {error}", key=self.key.decode(),
            error=f.getErrorMessage()))
        return True

    def set_holds(self, held: Mapping[str, Hold]) -> bool:
        """
        Keep the held deployments: local at once, written to etcd behind (a
        failure is logged). An operator's retry has written them already
        (L{SharedFleet}), so nothing is written then.
        """
        new = dict(held)
        if new == self.held:
            return False
        self.held = new
        d = self.write(lambda state: state.take_data(self.to_data()))
        d.addErrback(lambda f: self.log.error(
            "held deployments not kept in etcd {key}: {error}", key=self.key.decode(),
            error=f.getErrorMessage()))
        return True

    def set_rollouts(self, rollouts: Mapping[str, Mapping[str, Any]]) -> bool:
        """
        Keep the rollouts' control (paused, undone): local at once, written
        to etcd behind (a failure is logged), like the holds.
        """
        new = {m: dict(v) for m, v in rollouts.items()}
        if new == self.rollouts:
            return False
        self.rollouts = new
        d = self.write(lambda state: state.take_data(self.to_data()))
        d.addErrback(lambda f: self.log.error(
            "rollout control not kept in etcd {key}: {error}", key=self.key.decode(),
            error=f.getErrorMessage()))
        return True

    # -- etcd ---------------------------------------------------------------------------

    async def load_from(self, lease: int, seed: KeptState | None = None) -> list[str]:
        """
        Read the document from etcd into the local copy, for a leader that
        won under C{lease}; returns warnings. If etcd holds none, C{seed}'s
        state (this member's state file) is stored under the lease when it
        holds anything.

        @raise EtcdError: etcd could not be asked.
        """
        self.lease = lease
        kv = await defer.ensureDeferred(self.store.get(self.key))
        if kv is None:
            self.take_data({})
            self.revision = 0
            if seed is not None and seed.to_data() != KeptState(None).to_data():
                try:
                    await self.write(lambda state: state.take_data(seed.to_data()))
                except SharedStateError as e:
                    return [f"could not seed etcd {self.key.decode()} from {seed.path}: {e}"]
                self.log.info("etcd held no fleet state: stored {path}'s under {key}",
                              path=str(seed.path), key=self.key.decode())
            return []
        self.revision = kv.mod_revision
        try:
            self.take_data(json.loads(kv.value))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            self.take_data({})
            return [f"fleet state in etcd {self.key.decode()} (revision {kv.mod_revision}) is unreadable "
                    f"and was ignored (no scale overrides, no node cordoned or draining; the next "
                    f"change replaces it): {e}"]
        return []

    def follow(self, on_change: Callable[[], None]) -> Any:
        """
        Watch the key: a change this member did not make (the key edited or
        deleted by hand) is loaded, in turn with this member's writes, and
        C{on_change} called. Returns the watch (C{cancel}, C{done}).
        """
        def on_events(events: list[Any], revision: int) -> None:
            if any(ev.kv.mod_revision > self.revision for ev in events):
                d = self._lock.run(lambda: defer.ensureDeferred(self._reload(on_change)))
                d.addErrback(lambda f: self.log.error(
                    "fleet state in etcd {key} changed but could not be read: {error}",
                    key=self.key.decode(), error=f.getErrorMessage()))

        start = self.revision + 1 if self.revision else 0
        return self.store.watch(self.key, on_events, start_revision=start)

    async def _reload(self, on_change: Callable[[], None]) -> None:
        kv = await defer.ensureDeferred(self.store.get(self.key))
        if kv is None:
            if self.revision == 0:
                return
            self.take_data({})
            self.revision = 0
        else:
            if kv.mod_revision <= self.revision:
                return
            try:
                self.take_data(json.loads(kv.value))
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                self.log.error("fleet state in etcd {key} (revision {revision}) is unreadable and was "
                               "ignored; the running state stays: {error}", key=self.key.decode(),
                               revision=kv.mod_revision, error=str(e))
                self.revision = kv.mod_revision
                return
            self.revision = kv.mod_revision
        on_change()

    def step_down(self) -> None:
        """This member no longer leads: no write is attempted from now."""
        self.lease = None

    def write(self, change: Callable[[KeptState], None]) -> defer.Deferred[None]:
        """
        Write the local state changed by C{change} (called on a copy) to
        etcd; once etcd took it, the local copy becomes it. Fails with
        L{SharedStateError}, changing nothing, when this member does not
        lead, etcd refused it, or etcd could not be reached.
        """
        return self._lock.run(lambda: defer.ensureDeferred(self._write(change)))

    async def _write(self, change: Callable[[KeptState], None]) -> None:
        lease = self.lease
        if lease is None:
            self.refused += 1
            raise SharedStateError("this control-plane member does not lead: nothing changed")
        new = KeptState(None)
        new.take_data(self.to_data())
        change(new)
        value = json.dumps(new.to_data(), sort_keys=True).encode()
        here = Compare.mod_revision(self.key, self.revision) if self.revision else Compare.absent(self.key)
        try:
            result = await defer.ensureDeferred(self.store.txn(
                [Compare.held_by(leader_key(self.prefix), lease), here],
                [Put(self.key, value)],
                [Range(leader_key(self.prefix)), Range(self.key)],
            ))
        except EtcdError as e:
            self.refused += 1
            raise SharedStateError(f"etcd could not be reached ({e}): nothing changed") from e
        if result.succeeded:
            self.writes += 1
            self.revision = result.revision
            self.take_data(new.to_data())
            return
        self.refused += 1
        leader = result.kvs(0)
        if not leader or leader[0].lease != lease:
            self.lease = None
            raise SharedStateError("etcd refused the write: this control-plane member no longer "
                                   "leads (its lease is not the leader's): nothing changed")
        # Still the leader, but the key moved on without us (edited by
        # hand): take up what etcd holds, so the next change applies to it.
        current = result.kvs(1)
        self.revision = current[0].mod_revision if current else 0
        try:
            self.take_data(json.loads(current[0].value) if current else {})
        except (ValueError, KeyError, TypeError, AttributeError):
            pass
        raise SharedStateError(f"etcd {self.key.decode()} was changed by someone else since this "
                               f"member read it: nothing changed; its current state is loaded, try again")


def _refused(e: SharedStateError) -> AdminError:
    err = AdminError(str(e))
    err.status = 409
    return err


class SharedFleet:
    """
    The admin API's fleet in HA mode: the reconciler, with the operator's
    changes kept in etcd (L{SharedKeptState}) before they are applied.
    Everything else is the reconciler's. Its changes answer a Deferred, so
    it does not declare L{IFleetAdmin} (whose methods answer at once); the
    admin API waits for either.
    """

    def __init__(self, reconciler: Any, kept: SharedKeptState):
        self.reconciler = reconciler
        self.kept = kept

    def __getattr__(self, name: str) -> Any:
        return getattr(self.reconciler, name)

    def _then(self, change: Callable[[KeptState], None], apply: Callable[[], None]) -> defer.Deferred[None]:
        def failed(f: Any) -> None:
            f.trap(SharedStateError)
            raise _refused(f.value)

        d = self.kept.write(change)
        d.addCallbacks(lambda _: apply(), failed)
        return d

    def scale(self, model: str, replicas: int) -> defer.Deferred[None]:
        r = self.reconciler
        dep = placing.check_scale(r.ctx, model, replicas)
        scaler.refuse_fixed_scale(r.catalog, model)
        return self._then(lambda s: s.overrides.__setitem__(model, (replicas, dep.replicas)),
                          lambda: r.scale(model, replicas))

    def scale_bounds(self, model: str, min_replicas: int, max_replicas: int) -> defer.Deferred[None]:
        r = self.reconciler
        policy = scaler.check_bounds(r.catalog, model, min_replicas, max_replicas)
        entry = (min_replicas, max_replicas, policy.min_replicas, policy.max_replicas)
        return self._then(lambda s: s.bounds.__setitem__(model, entry),
                          lambda: r.scale_bounds(model, min_replicas, max_replicas))

    def _nodes(self, node_id: str, cordon: bool, drain: bool, apply: Callable[[str], None]) -> defer.Deferred[None]:
        from llmgw.control.core import nodes

        nodes.known(self.reconciler.ctx, node_id)

        def change(s: KeptState) -> None:
            if cordon:
                s.cordoned = s.cordoned | {node_id}
            else:
                s.cordoned, s.draining = s.cordoned - {node_id}, s.draining - {node_id}
            if drain:
                s.draining = s.draining | {node_id}

        return self._then(change, lambda: apply(node_id))

    def retry(self, model: str) -> defer.Deferred[None]:
        """
        Release C{model}'s hold: removed in etcd under the leader's lease,
        then in the reconciler (which lifts its backoff too).
        """
        r = self.reconciler
        placing.deployment(r.ctx, model)
        def change(s: KeptState) -> None:
            s.held.pop(model, None)

        return self._then(change, lambda: r.retry(model))

    def cordon(self, node_id: str) -> defer.Deferred[None]:
        return self._nodes(node_id, True, False, self.reconciler.cordon)

    def uncordon(self, node_id: str) -> defer.Deferred[None]:
        return self._nodes(node_id, False, False, self.reconciler.uncordon)

    def drain_node(self, node_id: str) -> defer.Deferred[None]:
        return self._nodes(node_id, True, True, self.reconciler.drain_node)
