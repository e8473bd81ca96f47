"""The proxy's HTTP listener: TLS, connection limits and timeouts, all from ProxyConfig.

``listener_config`` builds the uvicorn settings every way of running the proxy
uses (``tessera proxy`` and the tests):

- TLS when ``tls_cert_file``/``tls_key_file`` are set; with ``tls_ca_file``
  a client must present a certificate that CA signed.
- ``max_connections``: uvicorn's ``limit_concurrency``; a request arriving
  with that many connections (or requests) open gets 503.
- ``keep_alive_timeout_s``: an idle keep-alive connection is closed.
- ``request_header_timeout_s``: ``HeaderTimeoutH11Protocol`` closes a
  connection that has not delivered a complete request head in time, from
  its first byte (a new connection: from its opening). uvicorn has no such
  timeout of its own, so a client sending headers a byte at a time
  (slowloris) would hold a connection forever.
- ``request_body_timeout_s``: ``BodyDeadline`` answers 408 when the body has
  not arrived whole that long after the headers. Any response sent before
  the body was read whole (408, 413) closes the connection, since the rest of
  the body would otherwise be parsed as the next request.
"""
from __future__ import annotations

import asyncio
import functools
import ssl

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from common.config.roles import ProxyConfig
from proxy.errors import ApiError


class HeaderTimeoutH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, closing connections whose request head is not complete in time."""

    def __init__(self, *args, header_timeout_s: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._header_timeout_s = header_timeout_s
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE:  # still waiting for (the rest of) a request head
            if self._header_timer is None:
                self._arm_header_timer()
        else:
            self._disarm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        self._header_timer = self.loop.call_later(self._header_timeout_s, self._on_header_timeout)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.logger.warning("closed a connection from %s: no complete request head within "
                                "request_header_timeout_s=%ss", self.client, self._header_timeout_s)
            self.transport.close()


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
                raise ApiError(408, f"the request body did not arrive within request_body_timeout_s="
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
    if config.tls_cert_file:
        tls = {"ssl_certfile": config.tls_cert_file, "ssl_keyfile": config.tls_key_file}
        if config.tls_ca_file:
            tls |= {"ssl_ca_certs": config.tls_ca_file, "ssl_cert_reqs": ssl.CERT_REQUIRED}
    protocol = functools.partial(HeaderTimeoutH11Protocol, header_timeout_s=config.request_header_timeout_s)
    options = {"host": config.host, "port": config.port, "http": protocol,
               "limit_concurrency": config.max_connections, "timeout_keep_alive": config.keep_alive_timeout_s,
               # a /v1/stream message larger than this closes its socket (1009); smaller ones are checked
               # against max_prompt_bytes with an error frame (proxy/websocket_api.py)
               "ws_max_size": config.max_prompt_bytes + 65536, **tls}
    return uvicorn.Config(app, **{**options, **settings})
