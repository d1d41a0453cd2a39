"""
The certificate requests that wait for an operator (a control plane without
C{--signer}): C{GET /api/v1/csr} lists them, C{POST /api/v1/csr/NODE/approve}
with C{{"certificate_pem": PEM}} takes the certificate an operator signed
where the CA's key is (C{llmgw ctl csr approve NODE}), and C{POST
/api/v1/csr/NODE/deny} with C{{}} or C{{"reason": TEXT}} refuses it.

The certificate sent is checked against the request and the roots the
control plane trusts (L{llmgw.tlsconf.csr.check_issued}), never taken as
sent. The requests are kept in the memory of the member a node asked, so
these paths are each member's own on an HA control plane.
"""

from __future__ import annotations

from typing import Any

from twisted.web.resource import Resource

from llmgw.control.admin.base import AdminNode, Refused, at_end, json_body, segment
from llmgw.tlsconf.csr import RequestRefused
from llmgw.untrusted import clip
from llmgw.wire import InvalidNodeId, validate_node_id

#: The longest deny reason kept, in characters.
MAX_REASON = 500


def _authority(root: Any) -> Any:
    control = getattr(root, "control", None)
    authority = getattr(control, "joining", None)
    if authority is None:
        raise Refused(404, "this control plane takes no certificate requests (it runs without TLS)")
    return authority


class CertificateRequests(AdminNode):
    """C{GET /api/v1/csr}: every request kept for an operator, oldest first."""

    def render_GET(self, request: Any) -> dict[str, Any]:  # noqa: N802
        authority = _authority(self.root)
        return {"requests": authority.listing(), "signer": authority.signer_dir is not None}

    def getChild(self, path: bytes, request: Any) -> Resource:  # noqa: N802
        if path and len(request.postpath) == 1 and segment(request.postpath[0]) in ("approve", "deny"):
            return _Request(self.root, segment(path))
        return super().getChild(path, request)


class _Request(AdminNode):
    def __init__(self, root: Any, node_id: str):
        super().__init__(root)
        self.node_id = node_id

    def getChild(self, path: bytes, request: Any) -> Resource:  # noqa: N802
        action = segment(path)
        if at_end(request) and action in ("approve", "deny"):
            return Decision(self.root, self.node_id, action)
        return super().getChild(path, request)


class Decision(AdminNode):
    """C{POST /api/v1/csr/NODE/approve} or C{.../deny}."""

    def __init__(self, root: Any, node_id: str, action: str):
        super().__init__(root)
        self.node_id = node_id
        self.action = action

    def render_POST(self, request: Any) -> dict[str, Any]:  # noqa: N802
        try:
            node_id = validate_node_id(self.node_id)
        except InvalidNodeId as e:
            raise Refused(400, str(e)) from None
        body = json_body(request, self.root.max_body)
        authority = _authority(self.root)
        who = self.root.who(request)
        if self.action == "approve":
            unknown = sorted(set(body) - {"certificate_pem"})
            pem = body.get("certificate_pem")
            if unknown or not isinstance(pem, str) or not pem:
                raise Refused(400, 'the body is {"certificate_pem": PEM} (`llmgw ctl csr approve NODE` '
                                   "signs it where the CA's key is)")
            try:
                authority.approve(node_id, pem.encode("ascii", "replace"), who)
            except KeyError:
                raise Refused(404, f"no certificate request of node {node_id} waits here "
                                   "(`llmgw ctl csr list`)") from None
            except RequestRefused as e:
                self.root.log.warn("admin API: approval of node {node}'s certificate refused ({client}): "
                                   "{error}", node=node_id, client=who, error=str(e))
                raise Refused(409, f"the certificate is not what node {node_id} asked for: {e}") from None
            return {"node": node_id, "action": "approve", "ok": True}
        unknown = sorted(set(body) - {"reason"})
        reason = body.get("reason", "")
        if unknown or not isinstance(reason, str):
            raise Refused(400, f'the body is {{}} or {{"reason": TEXT}}, not fields {", ".join(map(clip, unknown))}')
        try:
            authority.deny(node_id, who, reason[:MAX_REASON].strip())
        except KeyError:
            raise Refused(404, f"no certificate request of node {node_id} waits here (`llmgw ctl csr list`)") from None
        return {"node": node_id, "action": "deny", "ok": True}
