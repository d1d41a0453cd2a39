"""
The admin API's HTTP client for C{llmgw ctl}: a plain blocking client
(C{urllib}, no reactor), since each command runs once and exits. It ignores
C{http_proxy} and friends, because the admin API is normally on loopback,
and a proxy would see (or fake) the fleet's state.

Against an HA control plane any member's URL does: one that does not lead
answers fleet reads and writes with C{307} to the leader's admin URL, which
L{AdminClient} follows (at most L{MAX_REDIRECTS} hops, with the same
certificate, never from C{https} to C{http}).
"""

from __future__ import annotations

import http.client
import json
import ssl
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any
from urllib.parse import urljoin, urlsplit

from llmgw.ctl.render import clean as _clean
from llmgw.tlsconf.options import admin_files

DEFAULT_ADMIN_URL = "http://127.0.0.1:7480"
ADMIN_ENV = "LLMGW_ADMIN_URL"
#: The older name of L{ADMIN_ENV}, still read.
ADMIN_ENV_OLD = "LLMGW_ADMIN"
CERTS_ENV = "LLMGW_ADMIN_CERTS"
AS_ENV = "LLMGW_ADMIN_AS"
DEFAULT_TIMEOUT = 10.0
#: Largest answer read from the admin API, in bytes.
MAX_ANSWER = 128 * 1024 * 1024

EXIT_OK = 0
EXIT_REFUSED = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3
EXIT_SERVER = 4

#: C{http(method, url, body, timeout) -> (status, body)}; raises
#: L{Unreachable} when no answer comes.
HTTPFunction = Callable[[str, str, bytes | None, float], tuple[int, bytes]]


class Unreachable(Exception):
    """
    No HTTP answer came from the control plane.
    """


class Redirected(Exception):
    """
    The admin API answered C{307} or C{308} with C{location}: a member of
    an HA control plane that does not lead sends the request to the leader.
    """

    def __init__(self, status: int, location: str, body: bytes = b""):
        super().__init__(f"HTTP {status} to {location}")
        self.status = status
        self.location = location
        #: The answer's body: the admin API's names the member that leads.
        self.body = body


#: Redirects one request follows at most (a member that does not lead sends
#: the client to the leader: one hop; more means members disagree).
MAX_REDIRECTS = 3


class CtlError(Exception):
    """
    A command ends with C{exit_code}; C{message} goes to stderr and C{body}
    (if any) is what C{--json} prints.
    """

    def __init__(self, exit_code: int, message: str, body: Any = None):
        super().__init__(message)
        self.exit_code = exit_code
        self.message = message
        self.body = body


def admin_ssl_context(certs_dir: str, name: str) -> ssl.SSLContext:
    """
    A TLS client context for the admin API: trust every root in
    C{certs_dir/ca.pem}, present C{admin-NAME.pem/.key}, check the server's
    name, TLS 1.2 at least. The files are checked first by the project's
    loader (expiry, key, issuer), so a mistake is named before dialling.

    @raise TLSConfigError: naming the file and what is wrong.
    """
    files = admin_files(certs_dir, name)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_verify_locations(cafile=str(files.ca_path))
    context.load_cert_chain(str(files.cert_path), str(files.key_path))
    return context


def urllib_http(
    method: str, url: str, body: bytes | None, timeout: float,
    context: ssl.SSLContext | None = None,
) -> tuple[int, bytes]:
    """
    One request with C{urllib}, without proxies; over TLS with C{context}
    for an C{https://} URL. A C{307}/C{308} is not followed here: it raises
    L{Redirected}, which L{AdminClient} follows.

    @raise Unreachable: no HTTP answer (connection refused, timeout, a
        refused TLS handshake, ...).
    """
    handlers: list[Any] = [urllib.request.ProxyHandler({}), _NoRedirect()]
    if context is not None:
        handlers.append(urllib.request.HTTPSHandler(context=context))
    opener = urllib.request.build_opener(*handlers)
    request = urllib.request.Request(
        url,
        data=body,
        method=method,
        headers={
            "Content-Type": "application/json",
            "Accept": "application/json",
            "User-Agent": "llmgw-ctl",
        },
    )
    try:
        with opener.open(request, timeout=timeout) as response:
            return response.status, response.read(MAX_ANSWER)
    except urllib.error.HTTPError as e:
        try:
            location = e.headers.get("Location") if e.headers is not None else None
            if e.code in (307, 308) and location:
                raise Redirected(e.code, location, e.read(64 * 1024)) from None
            return e.code, e.read(MAX_ANSWER)
        finally:
            e.close()
    except urllib.error.URLError as e:
        if isinstance(e.reason, ssl.SSLCertVerificationError):
            raise Unreachable(
                f"TLS: {e.reason.verify_message or e.reason} (is the control plane's certificate "
                "from the CA in --certs, and does it name the host in --admin-url? "
                "`llmgw ctl cert server --host HOST --renew` adds a name)"
            ) from e
        raise Unreachable(str(e.reason)) from e
    except (OSError, http.client.HTTPException) as e:
        raise Unreachable(str(e) or type(e).__name__) from e


def redirect_note(method: str, url: str, target: str, body: bytes) -> str:
    """
    The sentence saying that C{method} to C{url} went on to C{target}: who
    leads, as the redirecting member named it in C{body}, when it did.
    """
    leader = None
    try:
        answer = json.loads(body) if body else None
        if isinstance(answer, dict) and isinstance(answer.get("leader_id"), str):
            leader = answer["leader_id"]
    except (ValueError, UnicodeDecodeError):
        pass
    where = urlsplit(url)
    to = urlsplit(target)
    return (f"{where.scheme}://{_clean(where.netloc)} does not lead; {method} sent to the leader"
            + (f" {_clean(leader[:100])}" if leader else "") + f" at {to.scheme}://{_clean(to.netloc)}")


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


class AdminClient:
    """
    The admin API over an L{HTTPFunction}.
    """

    def __init__(self, base_url: str, http: HTTPFunction = urllib_http, timeout: float = DEFAULT_TIMEOUT,
                 on_redirect: Callable[[str], None] = lambda note: None):
        self.base_url = base_url.rstrip("/")
        self.http = http
        self.timeout = timeout
        #: Told a sentence for each redirect followed (C{llmgw ctl} writes
        #: it on stderr: the operator learns which member leads).
        self.on_redirect = on_redirect

    def get(self, path: str) -> Any:
        return self._call("GET", path, None)

    def post(self, path: str, body: Any = None) -> Any:
        return self._call("POST", path, json.dumps(body if body is not None else {}).encode())

    def put(self, path: str, body: Any) -> Any:
        return self._call("PUT", path, json.dumps(body).encode())

    def delete(self, path: str) -> Any:
        return self._call("DELETE", path, b"{}")

    def _call(self, method: str, path: str, body: bytes | None) -> Any:
        url = self.base_url + path
        status, raw, url = self._follow(method, url, body)
        try:
            answer = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            answer = None
        if 200 <= status < 300:
            if answer is None:
                raise CtlError(
                    EXIT_SERVER,
                    f"{method} {url} answered {status} with something that is not JSON: "
                    "is --admin-url the control plane's admin API?",
                    {"error": "the answer is not JSON", "status": status},
                )
            return answer
        reason = answer.get("error") if isinstance(answer, dict) else None
        if not isinstance(reason, str):
            reason = _clean(raw[:200].decode("utf-8", "replace")) or "(no reason given)"
        body_out = answer if isinstance(answer, dict) else {"error": reason, "status": status}
        if 400 <= status < 500:
            raise CtlError(EXIT_REFUSED, f"the control plane refused: {reason} (HTTP {status})", body_out)
        raise CtlError(EXIT_SERVER, f"the control plane failed: {reason} (HTTP {status})", body_out)

    def _follow(self, method: str, url: str, body: bytes | None) -> tuple[int, bytes, str]:
        """
        One request, following up to L{MAX_REDIRECTS} C{307}/C{308}
        answers (same method, body, TLS context and admin certificate); a
        redirect from C{https} to anything else is refused, so that no
        request leaves mutual TLS. Returns the status, body and the URL
        that answered.

        @raise CtlError: unreachable, or redirected too often or elsewhere.
        """
        for _ in range(MAX_REDIRECTS + 1):
            try:
                status, raw = self.http(method, url, body, self.timeout)
                return status, raw, url
            except Unreachable as e:
                where = urlsplit(url)
                raise CtlError(
                    EXIT_UNREACHABLE,
                    f"cannot reach the control plane at {where.scheme}://{where.netloc}: {e}",
                    {"error": f"cannot reach the control plane: {e}", "status": None},
                ) from None
            except Redirected as r:
                target = urljoin(url, r.location)
                scheme = urlsplit(target).scheme
                if scheme not in ("http", "https") or (urlsplit(url).scheme == "https" and scheme != "https"):
                    raise CtlError(
                        EXIT_SERVER,
                        f"{method} {url} was redirected to {_clean(target[:200])}, which is not "
                        + ("https (the request would leave TLS)" if scheme == "http" else "an http(s) URL")
                        + "; refusing to follow",
                        {"error": "redirect refused", "status": r.status},
                    ) from None
                self.on_redirect(redirect_note(method, url, target, r.body))
                url = target
        raise CtlError(
            EXIT_SERVER,
            f"{method} was redirected more than {MAX_REDIRECTS} times (last to {_clean(url[:200])}): "
            "do the control-plane members agree on the leader? `llmgw ctl status` on each says",
            {"error": "too many redirects", "status": None},
        )

