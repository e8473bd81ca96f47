"""The proxy's listener closes a connection whose client stopped reading its response (``http.write_timeout_s``):
the real uvicorn server with the listener's protocol (proxy/edge/listener.py), a real socket whose client never
reads, and an app streaming until it is told the client is gone."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading

import pytest
import uvicorn

from common.cli.local_cluster import free_port
from common.config.roles import ProxyConfig
from proxy.edge.listener import listener_config

CHUNK = b"x" * (256 << 10)


class Streamer:
    """An ASGI app streaming CHUNKs to each request until its client disconnects; how many it saw disconnect."""

    def __init__(self) -> None:
        self.disconnected = threading.Event()
        self.sent = 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            return await lifespan(receive, send)
        gone = asyncio.Event()

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()

        watcher = asyncio.create_task(watch())
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        while not gone.is_set():
            await send({"type": "http.response.body", "body": CHUNK, "more_body": True})  # waits while paused
            self.sent += 1
            await asyncio.sleep(0)  # a send to a closed connection returns at once: let the watcher run
        await watcher
        self.disconnected.set()


async def lifespan(receive, send) -> None:
    """An app's side of uvicorn's lifespan protocol: started, and shut down when told."""
    while (await receive())["type"] != "lifespan.shutdown":
        await send({"type": "lifespan.startup.complete"})
    await send({"type": "lifespan.shutdown.complete"})


def wait_for_abort(caplog) -> None:
    """Until the listener logs that it gave up on the connection (``http.write_timeout_s``, 0.3 s here)."""
    for _ in range(600):  # a bound, not a timing
        if any("http.write_timeout_s=0.3" in r.getMessage() for r in caplog.records):
            return
        threading.Event().wait(0.05)
    pytest.fail("the closing connection stayed open with its client reading nothing")


@contextlib.contextmanager
def silent_client(app, write_timeout_s: float, state: dict | None = None):
    """The real listener serving ``app`` in a thread, and a socket that sent it a request and reads nothing;
    ``state["server"]``: the uvicorn server."""
    config = ProxyConfig(port=free_port(), http={"write_timeout_s": write_timeout_s})
    server = uvicorn.Server(listener_config(app, config, log_config=None))
    if state is not None:
        state["server"] = server
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        for _ in range(600):  # until it listens (a bound, not a timing)
            if server.started:
                break
            threading.Event().wait(0.05)
        client = socket.socket()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.connect(("127.0.0.1", config.port))
        client.sendall(b"GET / HTTP/1.1\r\nHost: proxy\r\n\r\n")  # and never reads
        yield
        client.close()
    finally:
        server.should_exit = True
        thread.join(30)


def test_a_client_that_reads_nothing_is_disconnected_after_the_write_timeout(caplog):
    app = Streamer()
    with caplog.at_level(logging.WARNING), silent_client(app, 0.3):
        assert app.disconnected.wait(60), "the connection stayed open with its client reading nothing"
    assert app.sent >= 1
    assert any("http.write_timeout_s=0.3" in r.getMessage() for r in caplog.records), caplog.text


async def _one_body(scope, receive, send) -> None:
    """An app answering every request with one 8 MB body (not streamed), as a large JSON response is sent."""
    if scope["type"] == "lifespan":
        return await lifespan(receive, send)
    body = b"x" * (8 << 20)
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", str(len(body)).encode()), (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


def test_a_closing_connection_whose_client_reads_nothing_is_aborted_too(caplog):
    """The response is whole and the server closes the connection (``connection: close``), but the close waits for
    the buffered bytes, which a client that reads nothing never takes: the write timeout aborts it."""
    with caplog.at_level(logging.WARNING), silent_client(_one_body, 0.3):
        wait_for_abort(caplog)


def test_a_connection_closing_with_less_than_the_high_water_mark_unread_is_aborted_too(caplog):
    """The kernel's buffers full and a few KiB more buffered in the transport, below the 64 KiB at which
    ``pause_writing`` arms the write timeout: the response ends, the close waits for those bytes, and the client
    never reads them. The write timeout aborts it as well, rather than the connection staying open for good."""
    state: dict = {}

    async def fills_then_closes(scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            return await lifespan(receive, send)
        (protocol,) = state["server"].server_state.connections
        await send({"type": "http.response.start", "status": 200, "headers": [(b"connection", b"close")]})
        while protocol.transport.get_write_buffer_size() == 0:  # until the kernel takes no more
            await send({"type": "http.response.body", "body": b"x" * (4 << 10), "more_body": True})
            await asyncio.sleep(0)
        state["waiting"] = protocol.transport.get_write_buffer_size()
        await send({"type": "http.response.body", "body": b""})

    with caplog.at_level(logging.WARNING), silent_client(fills_then_closes, 0.3, state):
        wait_for_abort(caplog)
    assert 0 < state["waiting"] < 64 << 10
