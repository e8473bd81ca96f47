"""The proxy's HTTP listener: TLS, connection limits and timeouts (all from ProxyConfig), and the connection's own
write a streamed token's chunk takes.

``listener_config`` builds the uvicorn settings every way of running the proxy
uses (``tessera proxy`` and the tests):

- TLS when ``tls_cert_file``/``tls_key_file`` are set; with ``tls_ca_file``
  a client must present a certificate that CA signed.
- ``max_connections``: uvicorn's ``limit_concurrency``; a request arriving
  with that many connections (or requests) open gets 503.
- ``keep_alive_timeout_s``: an idle keep-alive connection is closed.
- ``request_header_timeout_s``: ``TimedHttpProtocol`` closes a
  connection that has not delivered a complete request head in time, from
  its first byte (a new connection: from its opening). uvicorn has no such
  timeout of its own, so a client sending headers a byte at a time
  (slowloris) would hold a connection forever.
- ``write_timeout_s``: ``TimedHttpProtocol`` aborts a connection whose
  client read none of its response for that long (its send buffer full, or
  the connection closing with any bytes unread); its request then ends as a
  disconnected client's. uvicorn's writes wait for the client without end,
  so a client that stops reading a stream would hold its connection (and
  its handler) for as long as the peer's kernel keeps the window shut.

HTTP is parsed by uvicorn's httptools protocol (llhttp, in C): writing a
streamed token's chunk through it costs a fraction of what its h11 protocol
(pure Python) costs (docs/history/benchmarks-rounds.md, "Issue 17").
- ``request_body_timeout_s``: ``BodyDeadline`` answers 408 when the body has
  not arrived whole that long after the headers. Any response sent before
  the body was read whole (408, 413) closes the connection, since the rest of
  the body would otherwise be parsed as the next request.
"""
from __future__ import annotations

import asyncio
import functools
import ssl
from collections.abc import Callable

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from common.config.roles import ProxyConfig
from proxy.core.errors import ApiError


class _Deadline:
    """One of a connection's timeouts: armed, disarmed, or run out, when it closes the connection naming its
    setting. ``pending`` (the write timeout's): the bytes waiting for the client; a deadline that runs out with
    fewer waiting than when it was armed saw the client read, and runs again from then; one that runs out without
    (a client that read nothing) aborts the connection, dropping what is buffered, even one already closing (whose
    close would wait for those bytes)."""

    def __init__(self, protocol: TimedHttpProtocol, setting: str, timeout_s: float, what: str,
                 pending: Callable[[], int] | None = None) -> None:
        self._protocol, self._setting, self._timeout_s, self._what, self._pending = (
            protocol, setting, timeout_s, what, pending)
        self._timer: asyncio.TimerHandle | None = None
        self._mark = 0

    def arm(self) -> None:
        """From now, unless it runs already."""
        if self._timer is None:
            self._mark = self._pending() if self._pending is not None else 0
            self._timer = self._protocol.loop.call_later(self._timeout_s, self._run_out)

    def disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _run_out(self) -> None:
        self._timer = None
        protocol = self._protocol
        if self._pending is not None:
            if self._pending() < self._mark:  # the client read some: it has another period
                self.arm()
                return
        elif protocol.transport.is_closing():
            return
        protocol.logger.warning("closed a connection from %s: %s within %s=%ss", protocol.client, self._what,
                                self._setting, self._timeout_s)
        if self._pending is not None:
            protocol.transport.abort()
        else:
            protocol.transport.close()


class TimedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, closing connections whose request head is not complete in time, or whose
    client has read nothing of the response for ``write_timeout_s``."""

    def __init__(self, *args, header_timeout_s: float, write_timeout_s: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._header_deadline = _Deadline(self, "http.request_header_timeout_s", header_timeout_s,
                                          "no complete request head")
        self._write_deadline = _Deadline(self, "http.write_timeout_s", write_timeout_s,
                                         "its client read none of the response", self._waiting_bytes)

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._header_deadline.arm()

    def on_message_begin(self) -> None:  # the first byte of a request
        super().on_message_begin()
        self._header_deadline.arm()

    def on_headers_complete(self) -> None:
        self._header_deadline.disarm()
        super().on_headers_complete()
        if getattr(self.cycle, "scope", None) is self.scope:  # an HTTP request (not a WebSocket's)
            self.scope[RAW_SEND] = self.cycle.send
            self.scope[RAW_WRITE] = functools.partial(self._write_body, self.cycle)

    def pause_writing(self) -> None:  # the send buffer is full: the client reads slower than it is written to
        super().pause_writing()
        self._write_deadline.arm()

    def resume_writing(self) -> None:
        self._write_deadline.disarm()
        super().resume_writing()

    def on_response_complete(self) -> None:  # also where a response whose connection closes (not kept alive) ends
        super().on_response_complete()
        self._closing()

    def timeout_keep_alive_handler(self) -> None:
        super().timeout_keep_alive_handler()
        self._closing()

    def shutdown(self) -> None:
        super().shutdown()
        self._closing()

    def _closing(self) -> None:
        """A close waits for the bytes still buffered for the client, and below the high-water mark no
        ``pause_writing`` armed the write timeout: a client that reads none of them is aborted by it too."""
        if self.transport.is_closing() and self._waiting_bytes():
            self._write_deadline.arm()

    def _waiting_bytes(self) -> int:
        return self.transport.get_write_buffer_size()

    def _write_body(self, cycle, body: bytes) -> bool:
        """Write a chunk of ``cycle``'s streamed (chunked) response body at once, as its ``send`` would; False,
        writing nothing, when that would have to wait (the client reads slower than it is written to) or the
        response is not streaming now: the caller then sends it through ``send``."""
        if (cycle is not self.cycle or not cycle.response_started or cycle.response_complete or cycle.disconnected
                or not cycle.chunked_encoding or self.flow.write_paused):
            return False
        self.transport.write(b"%x\r\n%b\r\n" % (len(body), body))
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        self._header_deadline.disarm()
        self._write_deadline.disarm()
        super().connection_lost(exc)


# the scope key of the server's own ``send`` (TimedHttpProtocol): a streamed response sends its start through
# every middleware, which may change it (BodyDeadline adds ``connection: close``), and its body chunks, which no
# layer changes, straight to the server (proxy.edge.openai_api.EventStreamResponse): one coroutine a chunk, not six
RAW_SEND = "tessera.send"
# the scope key of a function that writes a streamed response's body chunk at once, when it can without waiting
# (TimedHttpProtocol._write_body): a token's chunk then goes out from the handler that received the token
RAW_WRITE = "tessera.write"


class BodyDeadline:
    """ASGI middleware: the request body must arrive whole within ``timeout_s`` of the headers, else 408."""

    def __init__(self, app, timeout_s: float) -> None:
        self.app = app
        self.timeout_s = timeout_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        headers = dict(scope["headers"])
        body_complete = b"transfer-encoding" not in headers and headers.get(b"content-length", b"0") == b"0"

        async def timed_receive():
            nonlocal body_complete
            if body_complete:
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise ApiError(408, f"the request body did not arrive within http.request_body_timeout_s="
                                    f"{self.timeout_s}", code="request_timeout") from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_complete = True
            return message

        async def closing_send(message) -> None:
            if message["type"] == "http.response.start" and not body_complete:
                message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            await send(message)

        await self.app(scope, timed_receive, closing_send)


def listener_config(app, config: ProxyConfig, **settings) -> uvicorn.Config:
    """uvicorn settings for ``config``; ``settings`` adds or replaces uvicorn options."""
    tls = {}
    if config.security.tls_cert_file:
        tls = {"ssl_certfile": config.security.tls_cert_file, "ssl_keyfile": config.security.tls_key_file}
        if config.security.tls_ca_file:
            tls |= {"ssl_ca_certs": config.security.tls_ca_file, "ssl_cert_reqs": ssl.CERT_REQUIRED}
    protocol = functools.partial(TimedHttpProtocol, header_timeout_s=config.http.request_header_timeout_s,
                                 write_timeout_s=config.http.write_timeout_s)
    options = {"host": config.host, "port": config.port, "http": protocol,
               "limit_concurrency": config.http.max_connections, "timeout_keep_alive": config.http.keep_alive_timeout_s,
               # a /v1/stream message larger than this closes its socket (1009); smaller ones are checked
               # against max_prompt_bytes with an error frame (proxy/edge/websocket_api.py)
               "ws_max_size": config.http.max_prompt_bytes + 65536, "access_log": config.http.access_log, **tls}
    return uvicorn.Config(app, **{**options, **settings})
