"""
C{/api/v1/deployments/MODEL/rollout}: a deployment's rollout
(L{llmgw.control.core.rolling}). C{GET} answers its status; C{POST
.../rollout/pause}, C{/resume} and C{/undo} (body C{{}} or nothing; the
operator role, like every write) control it and answer the status after.
"""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import Deferred, maybeDeferred
from twisted.web.resource import Resource

from llmgw.control.admin.base import AdminNode, Refused, at_end, json_body, segment

ROLLOUT_ACTIONS = ("pause", "resume", "undo")


class Rollout(AdminNode):
    """
    C{GET /api/v1/deployments/MODEL/rollout}; its actions hang below it.
    """

    def __init__(self, root: Any, model: str):
        super().__init__(root)
        self.model = model

    def getChild(self, path: bytes, request: Any) -> Resource:  # noqa: N802
        action = segment(path)
        if action in ROLLOUT_ACTIONS and at_end(request):
            return RolloutAction(self.root, self.model, action)
        if path == b"" and not request.postpath:
            return self
        return super().getChild(path, request)

    def render_GET(self, request: Any) -> dict[str, Any]:  # noqa: N802
        if not self.model:
            raise Refused(400, "the model name is empty")
        answer: dict[str, Any] = self.root.fleet.rollout_status(self.model)
        return answer


class RolloutAction(AdminNode):
    """
    C{POST /api/v1/deployments/MODEL/rollout/pause}, C{/resume} or C{/undo}.
    """

    def __init__(self, root: Any, model: str, action: str):
        super().__init__(root)
        self.model = model
        self.action = action

    def render_POST(self, request: Any) -> Deferred[dict[str, Any]]:  # noqa: N802
        if not self.model:
            raise Refused(400, "the model name is empty")
        if json_body(request, self.root.max_body):
            raise Refused(400, f"rollout {self.action} takes no fields; send {{}} or nothing")
        fleet, model, action = self.root.fleet, self.model, self.action
        do = {"pause": fleet.rollout_pause, "resume": fleet.rollout_resume, "undo": fleet.rollout_undo}[action]

        def done(status: dict[str, Any]) -> dict[str, Any]:
            self.root.log.info("admin API: rollout {action} {model} (asked by {client})",
                               action=action, model=model, client=self.root.who(request))
            return {**status, "action": action, "ok": True}

        return maybeDeferred(do, model).addCallback(done)
