"""
Deploying from the admin API: C{PUT /api/v1/deployments/MODEL} adds or
changes a deployment, C{DELETE} removes it, each written where the control
plane keeps its catalog and then acted on as a catalog reload is.

The body of a C{PUT} is the deployment's table as the catalog file writes
it, in JSON (C{{"profile": "fake-1gpu", "replicas": 2}},
C{{"source": "hf://org/repo", "profile": "vllm-1gpu", "min_replicas": 0,
"max_replicas": 4}}); the model is the path's. It is validated with the
rest of the catalog by the code that reads the file
(L{llmgw.control.core.catalogedit}), so a refusal (400) says what the file
would say of the same entry.

Where it is written:

- a single control plane: its C{--catalog} file, replaced atomically (a
  reader or a crash sees the old file or the new one) with only that
  deployment's table changed, then reloaded;
- a member of an HA control plane: the catalog in etcd, by the leader,
  under its lease and only if nobody changed it since it was read (the
  compare-and-swap C{llmgw ctl catalog apply} makes), then applied
  (L{llmgw.control.ha.member.HAMember.edit_catalog}).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from twisted.internet.defer import Deferred, ensureDeferred, maybeDeferred

from llmgw.control.admin.base import AdminNode, Refused, bounded, json_body
from llmgw.control.core.catalog import CatalogError
from llmgw.control.core.catalogedit import Edited, put_deployment, remove_deployment
from llmgw.control.core.kept import write_atomically
from llmgw.control.state.interfaces import AdminError

#: A change to a catalog's text: the old text and where it is, to the new.
Change = Callable[[bytes, str], Edited]


def refused(status: int, message: str) -> AdminError:
    """
    An L{AdminError} the API answers with C{status}.
    """
    error = AdminError(message)
    error.status = status  # type: ignore[attr-defined]
    return error


def edit_file(fleet: Any, change: Change) -> dict[str, Any]:
    """
    Apply C{change} to the catalog file of C{fleet} (a single control
    plane), then reload it. Returns C{{"stored": PATH, "changes": ...}}.

    @raise AdminError: 409, no catalog file; 400, the change is refused; 500
        class errors as they come (the file could not be written).
    """
    path = fleet.status().get("catalog")
    if not path:
        raise refused(409, "the control plane was started without --catalog: there is no catalog "
                           "file to write the deployment into")
    p = Path(path)
    try:
        text = p.read_bytes()
    except OSError as e:
        raise refused(409, f"catalog {path!r} cannot be read: {e.strerror or e}") from None
    try:
        edited = change(text, repr(path))
    except CatalogError as e:
        raise refused(400, str(e)) from None
    write_atomically(p, edited.text, keep_mode=True)
    changes = fleet.reload_catalog()
    return {"stored": path, "changes": changes}


def edit_catalog(root: Any, change: Change) -> Deferred[dict[str, Any]]:
    """
    Apply C{change} where C{root}'s control plane keeps its catalog: etcd
    on an HA member, else the catalog file.
    """
    ha = getattr(root.control, "ha", None)
    if ha is not None:
        return ensureDeferred(ha.edit_catalog(change))
    return maybeDeferred(edit_file, root.fleet, change)


def put_change(model: str, fields: dict[str, Any]) -> Change:
    def change(text: bytes, where: str) -> Edited:
        return put_deployment(text, model, fields, where)
    return change


def remove_change(model: str) -> Change:
    def change(text: bytes, where: str) -> Edited:
        try:
            return remove_deployment(text, model, where)
        except KeyError:
            raise refused(404, f"the catalog has no deployment {model!r}") from None
    return change


class DeploymentEdits(AdminNode):
    """
    The methods of C{/api/v1/deployments/MODEL} itself: C{PUT} (the body:
    the deployment's fields as in the catalog file) and C{DELETE}.
    """

    model: str

    def _model_name(self) -> str:
        if not self.model:
            raise Refused(400, "the model name is empty")
        return self.model

    def render_PUT(self, request: Any) -> Deferred[dict[str, Any]]:  # noqa: N802
        model = self._model_name()
        fields = json_body(request, self.root.max_body)
        if "model" in fields and fields["model"] != model:
            raise Refused(400, f"the body's 'model' differs from the path's ({model!r}); leave it out")

        def done(result: dict[str, Any]) -> dict[str, Any]:
            self.root.log.info("admin API: deployment {model} set to {fields} in {stored} (asked by {client})",
                               model=model, fields=bounded(json.dumps(fields)), stored=result["stored"],
                               client=self.root.who(request))
            return {"model": model, "ok": True, **result}

        return edit_catalog(self.root, put_change(model, fields)).addCallback(done)

    def render_DELETE(self, request: Any) -> Deferred[dict[str, Any]]:  # noqa: N802
        model = self._model_name()
        if json_body(request, self.root.max_body):
            raise Refused(400, "delete takes no fields; send {} or nothing")

        def done(result: dict[str, Any]) -> dict[str, Any]:
            self.root.log.info("admin API: deployment {model} deleted from {stored} (asked by {client})",
                               model=model, stored=result["stored"], client=self.root.who(request))
            return {"model": model, "ok": True, "deleted": True, **result}

        return edit_catalog(self.root, remove_change(model)).addCallback(done)


class CatalogView(AdminNode):
    """
    C{GET /api/v1/catalog}: what the console's deploy form offers and
    edits: the profiles (name, engine, GPUs) and each deployment's table
    as the catalog writes it. Its child C{reload} reloads the file.
    """

    def render_GET(self, request: Any) -> dict[str, Any]:  # noqa: N802
        catalog = getattr(self.root.fleet, "catalog", None)
        if catalog is None:
            return {"profiles": [], "deployments": {}}
        profiles = [
            {"name": p.name, "engine": p.engine, "shards": p.shards, "gpus_per_shard": p.gpus_per_shard,
             "gpu_memory_mb": p.gpu_memory_mb, "needs_source": not p.command}
            for p in sorted(catalog.profiles.values(), key=lambda p: p.name)
        ]
        return {"profiles": profiles, "deployments": {m: dict(e) for m, e in sorted(catalog.entries.items())}}
