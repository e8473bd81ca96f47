"""The proxy's request limits over real sockets: body size, slow bodies, slow headers, connections, max_tokens.

Each test starts its own proxy (``proxy_harness``) with small limits and talks
to it over raw TCP where a well-behaved HTTP client could not misbehave the
way an attacker does.
"""
from __future__ import annotations

import json
import socket
import time

import httpx

from tests.conditions import settle
from tests.e2e.proxy_harness import (  # noqa: F401
    MESSAGES, MODEL, PATIENCE_S, assert_openai_error, make_proxy, tokenizer,
)

CHAT = "/v1/chat/completions"


def connect(proxy) -> socket.socket:
    host, port = proxy.url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response (with Content-Length) from ``sock``."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before a response head: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in header_lines)}
    while len(body) < int(headers.get("content-length", 0)):
        body += sock.recv(65536)
    return int(status_line.split()[1]), headers, body


def closed_within(sock: socket.socket, timeout: float) -> bool:
    """True once the peer closes ``sock`` (recv returns b""), False if it stays open ``timeout`` seconds."""
    sock.settimeout(timeout)
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True
    return True


def post_head(length: int) -> bytes:
    return (f"POST {CHAT} HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


def test_a_body_over_the_limit_gets_413_before_it_is_sent(make_proxy):
    proxy = make_proxy(http={"max_prompt_bytes": 4096})
    sock = connect(proxy)
    sock.sendall(post_head(50_000_000) + b'{"model": "')  # declares 50 MB, sends a few bytes
    status, headers, body = read_response(sock)
    assert status == 413
    error = json.loads(body)["error"]
    assert error["code"] == "request_too_large" and "http.max_prompt_bytes=4096" in error["message"]
    assert headers.get("connection") == "close"
    assert closed_within(sock, 5.0)


def test_a_chunked_body_over_the_limit_gets_413(make_proxy):
    proxy = make_proxy(http={"max_prompt_bytes": 4096})

    def chunks():
        for _ in range(100):
            yield b" " * 1024

    response = proxy.http.post(CHAT, content=chunks(), headers={"Content-Type": "application/json"})
    assert_openai_error(response, 413, "http.max_prompt_bytes=4096")


def test_a_body_that_arrives_too_slowly_gets_408(make_proxy):
    proxy = make_proxy(http={"request_body_timeout_s": 0.5})
    sock = connect(proxy)
    sock.sendall(post_head(100) + b'{"model": ')  # then nothing more
    status, headers, body = read_response(sock)
    assert status == 408
    error = json.loads(body)["error"]  # the body's timeout, not another limit, named in the answer
    assert error["code"] == "request_timeout" and "http.request_body_timeout_s=0.5" in error["message"]
    assert closed_within(sock, 5.0)


def test_headers_dribbled_too_slowly_close_the_connection(make_proxy):
    proxy = make_proxy(http={"request_header_timeout_s": 0.5})
    sock = connect(proxy)
    sock.sendall(b"GET /v1/models HTTP/1.1\r\n")
    for byte in b"Host: proxy\r\nX-Slow: ":  # a byte every 50 ms: never a complete head in time
        try:
            sock.sendall(bytes([byte]))
        except (BrokenPipeError, ConnectionResetError):
            break
        time.sleep(0.05)
    assert closed_within(sock, 5.0)  # a head that never completes: closed, never answered
    assert proxy.http.get("/v1/models").status_code == 200  # the listener itself is fine


def test_an_idle_connection_is_closed_and_a_prompt_one_is_served(make_proxy):
    proxy = make_proxy(http={"request_header_timeout_s": 0.5, "keep_alive_timeout_s": 0.5})
    idle = connect(proxy)
    assert closed_within(idle, 5.0)  # opened, said nothing
    sock = connect(proxy)
    sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: proxy\r\n\r\n")
    status, _, body = read_response(sock)
    assert status == 200 and json.loads(body)["data"][0]["id"] == MODEL
    assert closed_within(sock, 5.0)  # keep-alive ran out


def test_connections_beyond_max_connections_get_503(make_proxy):
    proxy = make_proxy(http={"max_connections": 2})
    held = [connect(proxy), connect(proxy)]
    response = httpx.get(proxy.url + "/v1/models", timeout=10)
    assert response.status_code == 503
    for sock in held:
        sock.close()
    settle(lambda: httpx.get(proxy.url + "/v1/models", timeout=10).status_code, lambda status: status == 200,
           PATIENCE_S, "a connection is served again once the server saw the held ones close (max_connections)")


def test_max_tokens_above_the_limit_is_refused(make_proxy):
    proxy = make_proxy(requests={"max_tokens_limit": 64, "max_tokens_default": 16})
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 65}
    error = assert_openai_error(proxy.http.post(CHAT, json=body), 400, "at most 64 tokens")
    assert error["param"] == "max_tokens"
