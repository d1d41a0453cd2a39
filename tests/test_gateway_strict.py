"""
The gateway's front held to RFC 9110/9112 where a lenient reading would
let the gateway and what reads a request after it disagree: absolute-form
targets, a repeated C{Authorization}, chunk extensions and trailers, and
JSON that only Python's C{json} takes.
"""

from __future__ import annotations

import json

from twisted.trial.unittest import SynchronousTestCase

from llmgw.gateway.chunked import MAX_TRAILER_LINES
from llmgw.gateway.httphead import HeadRefused, parse_head
from llmgw.hostcheck import HostCheck
from tests.test_gateway_front import Server, responses
from tests.test_gateway_resource import Front, error_of, post


class AbsoluteFormTests(SynchronousTestCase):
    def test_parsed(self) -> None:
        """
        An absolute-form target (either scheme, any case) is read as its
        path and query, and its authority replaces the C{Host} header; an
        HTTP/1.0 request without C{Host} gets the authority as its C{Host}.
        """
        cases = [
            (b"http://gw:8000/v1/models", b"/v1/models", b"gw:8000"),
            (b"HTTPS://gw/v1/models?x=1", b"/v1/models?x=1", b"gw"),
            (b"http://gw", b"/", b"gw"),
            (b"http://gw?x", b"/?x", b"gw"),
        ]
        for target, uri, host in cases:
            head = b"GET " + target + b" HTTP/1.1\r\nHost: other\r\nA: b"
            _, got_uri, _, headers, *_ = parse_head(head)
            self.assertEqual(got_uri, uri, target)
            self.assertEqual([v for n, v in headers if n == b"host"], [host], target)
            self.assertIn((b"a", b"b"), headers)
        _, uri, http10, headers, *_ = parse_head(b"GET http://gw/v1/models HTTP/1.0")
        self.assertEqual((uri, http10, headers), (b"/v1/models", True, [(b"host", b"gw")]))

    def test_refused(self) -> None:
        """
        A target that is neither a path nor an http(s) URL with a host and
        no user info is a 400 naming it; an HTTP/1.1 absolute-form request
        still needs its C{Host}.
        """
        for target in (b"ftp://gw/x", b"gw/v1/models", b"*", b"http:/gw/x", b"http:///x", b"http://u@gw/x"):
            e = self.assertRaises(HeadRefused, parse_head, b"GET " + target + b" HTTP/1.1\r\nHost: gw")
            self.assertEqual(e.status, 400, target)
            self.assertIn("request target", e.message)
        e = self.assertRaises(HeadRefused, parse_head, b"GET http://gw/ HTTP/1.1")
        self.assertEqual(e.status, 400)

    def test_routed_and_host_checked(self) -> None:
        """
        C{POST http://host/v1/chat/completions} reaches a replica like its
        origin-form twin, and the C{Host} checked and forwarded is the
        target's authority, not the C{Host} header.
        """
        front = Front(hosts=HostCheck(["gw.example.com"]))
        front.send(post(b'{"model": "demo"}', host=b"evil.example", path=b"http://gw.example.com/v1/chat/completions"))
        self.assertEqual(len(front.clock.tcpClients), 1)
        conn, transport = front.upstream()
        self.assertTrue(transport.value().startswith(b"POST /v1/chat/completions HTTP/1.1\r\n"))
        status, _, body = front.answer(
            post(b'{"model": "demo"}', host=b"gw.example.com", path=b"http://evil.example/v1/chat/completions")
        )
        self.assertEqual((status, error_of(body)["code"]), (421, "misdirected_request"))
        self.assertIn("evil.example", error_of(body)["message"])
        status, _, _ = front.answer(b"GET http://localhost:8000/v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        self.assertEqual(status, 200)


class HeadFieldTests(SynchronousTestCase):
    def test_fields_as_read(self) -> None:
        """
        Header names come in lower case and values without the blanks
        around them (those inside kept, an empty value empty), in arrival
        order.
        """
        head = b"POST /v1/x HTTP/1.1\r\nHost:  gw \t\r\nX-A: \t a \t b \t\r\nX-Empty: \t \r\nCONTENT-length:2"
        method, uri, http10, headers, length, chunked, keep_alive, expect = parse_head(head)
        self.assertEqual(
            headers, [(b"host", b"gw"), (b"x-a", b"a \t b"), (b"x-empty", b""), (b"content-length", b"2")]
        )
        self.assertEqual((method, uri, http10, length, chunked, keep_alive, expect),
                         (b"POST", b"/v1/x", False, b"2", False, True, False))

    def test_first_fault_is_told(self) -> None:
        """
        A head with a bad Content-Length before a malformed header line is
        refused for the Content-Length; the other way round, for the line.
        """
        bad_length = b"Content-Length: 1x"
        bad_line = b"Bad Name: x"
        e = self.assertRaises(HeadRefused, parse_head, b"GET / HTTP/1.1\r\nHost: a\r\n%s\r\n%s" % (bad_length, bad_line))
        self.assertIn("Content-Length", e.message)
        e = self.assertRaises(HeadRefused, parse_head, b"GET / HTTP/1.1\r\nHost: a\r\n%s\r\n%s" % (bad_line, bad_length))
        self.assertIn("Malformed header line", e.message)


class AuthorizationTests(SynchronousTestCase):
    def test_twice_is_400(self) -> None:
        """
        Two C{Authorization} headers (whichever case) are a 400 before the
        handler sees the request, and the connection closes.
        """
        s = Server()
        s.feed(b"GET /v1/models HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer a\r\n"
               b"authorization: Bearer b\r\n\r\n")
        ((status, _, body),) = responses(s.output())
        self.assertEqual(status, 400)
        self.assertIn("more than one Authorization", json.loads(body)["error"]["message"])
        self.assertEqual(s.requests, [])
        self.assertTrue(s.transport.disconnecting)
        s = Server()
        s.feed(b"GET /v1/models HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer a\r\n\r\n")
        self.assertEqual(len(s.requests), 1)


class ChunkedFrontTests(SynchronousTestCase):
    start = b"POST / HTTP/1.1\r\nHost: gw\r\nTransfer-Encoding: chunked\r\n\r\n"

    def test_bad_extension_is_400(self) -> None:
        """
        A chunk extension with a bare LF (or that is otherwise not RFC
        9112's) is a 400 whole or byte by byte, and the handler never sees
        the request; a well-formed one is accepted.
        """
        for data in (b"5;a\nb\r\nhello\r\n0\r\n\r\n", b"5;a=b c\r\nhello\r\n0\r\n\r\n"):
            for bytewise in (False, True):
                s = Server()
                s.feed(self.start + data, bytewise)
                ((status, _, body),) = responses(s.output())
                self.assertEqual(status, 400, data)
                self.assertIn("chunk extension", json.loads(body)["error"]["message"])
                self.assertEqual(s.requests, [])
        s = Server()
        s.feed(self.start + b'5 ; a = "b c"\r\nhello\r\n0\r\n\r\n')
        self.assertEqual([r.body for r in s.requests], [b"hello"])

    def test_trailer_bounded(self) -> None:
        """
        A trailer of more lines than a head may have is a 431; one of as
        many is accepted.
        """
        s = Server()
        s.feed(self.start + b"0\r\n" + b"X: y\r\n" * (MAX_TRAILER_LINES + 1) + b"\r\n")
        ((status, _, body),) = responses(s.output())
        self.assertEqual((status, json.loads(body)["error"]["code"]), (431, "head_too_large"))
        self.assertEqual(s.requests, [])
        s = Server()
        s.feed(self.start + b"0\r\n" + b"X: y\r\n" * MAX_TRAILER_LINES + b"\r\n")
        self.assertEqual(len(s.requests), 1)


class JSONBodyTests(SynchronousTestCase):
    def test_nan_infinity_bom_are_400(self) -> None:
        """
        A body with C{NaN}, C{Infinity} or a leading byte order mark gets a
        400 saying which, and reaches no replica.
        """
        front = Front()
        cases = [
            (b'{"model": "demo", "temperature": NaN}', "NaN"),
            (b'{"model": "demo", "max_tokens": Infinity}', "Infinity"),
            (b'\xef\xbb\xbf{"model": "demo"}', "byte order mark"),
        ]
        for body, reason in cases:
            status, _, answer = front.answer(post(body))
            self.assertEqual(status, 400, body)
            err = error_of(answer)
            self.assertEqual(err["code"], "invalid_json")
            self.assertIn(reason, err["message"])
        self.assertEqual(front.clock.tcpClients, [])
