"""The /v1/stream WebSocket (proxy/edge/websocket_api.py) over a real socket: a proxy server in this process and
scripted workers (tokens every 50 ms), then a real cluster on a tiny model for the output itself."""
from __future__ import annotations

import json

import httpx
import pytest
from websockets.exceptions import ConnectionClosedOK, InvalidStatus
from websockets.sync.client import connect

from common.cli.local_cluster import LocalCluster
from common.config.roles import TenantConfig
from common.protocol.wire import Abort, DecodeRequest
from proxy.tenancy.api_keys import hash_key
from tests.e2e.proxy_harness import (  # noqa: F401
    MESSAGES, MODEL, PATIENCE_S, SCRIPT_TEXT, SLOW_TOKEN_INTERVAL_S, make_proxy, make_worker, ready, script,
    slow_cluster, tokenizer,
)
from tests.conditions import settle


def socket_url(url: str) -> str:
    return url.replace("http://", "ws://") + "/v1/stream"


def request(cid: str, kind: str = "completions", **fields) -> str:
    body = {"model": MODEL, "max_tokens": 50, **({"messages": MESSAGES} if kind == "chat.completions"
                                                  else {"prompt": "Hi"})}
    return json.dumps({"type": kind, "id": cid, "body": {**body, **fields.pop("body", {})}, **fields})


def frames_until_done(socket, ids: set[str], timeout: float = 30) -> dict[str, list[dict]]:
    """Every frame of each request in ``ids``, until each has its ``done`` frame."""
    frames: dict[str, list[dict]] = {cid: [] for cid in ids}
    open_ = set(ids)
    while open_:
        frame = json.loads(socket.recv(timeout=timeout))
        frames[frame["id"]].append(frame)
        if frame.get("done"):
            open_.discard(frame["id"])
    return frames


def text(frames: list[dict], field: str = "text") -> str:
    out = ""
    for frame in frames:
        for choice in (frame.get("data") or {}).get("choices", []):
            out += (choice.get("delta", {}).get("content") if field == "content" else choice.get("text")) or ""
    return out


def test_two_requests_stream_at_once_on_one_socket_with_the_sse_streams_events(slow_cluster):
    proxy, _ = slow_cluster()
    with connect(socket_url(proxy.url)) as socket:
        socket.send(request("a"))
        socket.send(request("b", "chat.completions", body={"stream_options": {"include_usage": True}}))
        frames = frames_until_done(socket, {"a", "b"})
    assert text(frames["a"]) == SCRIPT_TEXT and text(frames["b"], "content") == SCRIPT_TEXT
    assert frames["a"][0]["data"]["object"] == "text_completion"
    assert frames["b"][0]["data"]["object"] == "chat.completion.chunk"
    assert frames["b"][-2]["data"]["usage"]["completion_tokens"] > 0  # the usage chunk, as in SSE
    sse = proxy.http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 50,
                                                   "stream": True}).text
    sse_data = [json.loads(line[6:]) for line in sse.split("\n\n") if line.startswith("data: {")]
    assert [c["choices"] for c in sse_data] == [f["data"]["choices"] for f in frames["a"][:-1]]


def test_a_cancel_message_ends_the_request_and_the_worker_is_told(slow_cluster):
    proxy, decode = slow_cluster()
    with connect(socket_url(proxy.url)) as socket:
        socket.send(request("long", body={"max_tokens": 2000}))
        first = json.loads(socket.recv(timeout=30))
        assert first["id"] == "long" and "data" in first
        socket.send(json.dumps({"type": "cancel", "id": "long"}))
        frames = frames_until_done(socket, {"long"})["long"]
        assert frames[-1] == {"id": "long", "done": True}
        decode.wait_for(lambda m: isinstance(m, Abort), timeout=10)
        settle(lambda: dict(proxy.services.cluster.inflight), lambda inflight: not inflight, PATIENCE_S,
               "the cancelled request leaves the proxy")
        socket.send(request("next"))  # the socket serves on
        assert text(frames_until_done(socket, {"next"})["next"]) == SCRIPT_TEXT


def test_a_socket_that_closes_cancels_its_requests(slow_cluster):
    proxy, decode = slow_cluster()
    with connect(socket_url(proxy.url)) as socket:
        socket.send(request("long", body={"max_tokens": 2000}))
        socket.recv(timeout=30)
    decode.wait_for(lambda m: isinstance(m, Abort), timeout=10)
    settle(lambda: dict(proxy.services.cluster.inflight), lambda inflight: not inflight, PATIENCE_S,
           "the cancelled request leaves the proxy")


def test_bad_messages_get_error_frames_naming_the_problem_and_the_socket_stays_open(slow_cluster):
    proxy, _ = slow_cluster()
    with connect(socket_url(proxy.url)) as socket:
        cases = [
            ("not json", None, 400, "not JSON"),
            (json.dumps([1]), None, 400, "JSON object"),
            (json.dumps({"type": "completions"}), None, 400, "id must be"),
            (json.dumps({"type": "edits", "id": "x"}), "x", 400, "type must be"),
            (request("y", body={"max_tokens": -1}), "y", 400, "max_tokens"),
            (request("z", body={"model": "nowhere"}), "z", 404, "does not exist"),
            ("x" * 5000, None, 413, "max_prompt_bytes"),
            (b"\xff\xfe binary", None, 400, "not JSON"),
        ]
        for message, cid, status, words in cases:
            socket.send(message)
            frame = json.loads(socket.recv(timeout=30))
            assert frame["id"] == cid and frame["status"] == status, frame
            assert words in frame["data"]["error"]["message"], frame
        socket.send(request("ok"))
        assert text(frames_until_done(socket, {"ok"})["ok"]) == SCRIPT_TEXT


def test_a_resumable_request_survives_its_socket_and_resumes_on_another(slow_cluster):
    proxy, decode = slow_cluster(requests={"resume_window_s": 60})
    with connect(socket_url(proxy.url)) as socket:
        socket.send(request("r", resumable=True))
        seen = [json.loads(socket.recv(timeout=30)) for _ in range(3)]
    assert [f["event"] for f in seen] == [0, 1, 2]
    response_id = seen[0]["data"]["id"]
    settle(lambda: proxy.services.streams.streams[response_id].finished, bool, PATIENCE_S,
           "the request runs to its end with nobody connected")
    with connect(socket_url(proxy.url)) as socket:
        socket.send(json.dumps({"type": "resume", "id": "again", "response_id": response_id,
                                "last_event_id": 2}))
        rest = frames_until_done(socket, {"again"})["again"]
        assert rest[0]["event"] == 3
        socket.send(json.dumps({"type": "resume", "id": "gone", "response_id": "cmpl-nope", "last_event_id": 0}))
        assert json.loads(socket.recv(timeout=30))["status"] == 404
    assert text(seen) + text(rest) == SCRIPT_TEXT and not decode.messages(Abort)


def test_a_bad_key_is_refused_before_the_socket_opens_and_a_good_one_is_its_tenants(make_proxy, make_worker):
    proxy = make_proxy(tenancy={"auth_enabled": True, "tenants": (TenantConfig("alice", api_key_sha256=(hash_key("sk-a"),)),)})
    make_worker(proxy, "d0", "decode")
    ready(proxy)
    with pytest.raises(InvalidStatus) as refused:
        connect(socket_url(proxy.url), additional_headers={"Authorization": "Bearer sk-wrong"})
    assert refused.value.response.status_code == 401
    with connect(socket_url(proxy.url), additional_headers={"Authorization": "Bearer sk-a"}) as socket:
        socket.send(request("a"))
        assert text(frames_until_done(socket, {"a"})["a"]) == SCRIPT_TEXT
    counted = proxy.http.get("/metrics").text  # counted as the request ended, before its last frame went out
    assert 'tessera_proxy_tenant_requests_total{model="SmolLM2-135M-Instruct",status="ok",tenant="alice"}' in counted


def test_a_real_cluster_streams_over_a_socket_what_it_streams_over_http(tiny_chat_model_dir, tmp_path):
    cluster = LocalCluster.for_tests(tiny_chat_model_dir, tmp_path, transfer_backend="zmq",
                                     proxy_overrides=["served_model_name=tiny"]).start()
    try:
        body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
        http = httpx.post(cluster.url + "/v1/chat/completions", json=body, timeout=120).json()
        with connect(socket_url(cluster.url)) as socket:
            socket.send(json.dumps({"type": "chat.completions", "id": "t", "body": body}))
            frames = frames_until_done(socket, {"t"}, timeout=120)["t"]
        assert text(frames, "content") == http["choices"][0]["message"]["content"]
        assert frames[-2]["data"]["choices"][0]["finish_reason"] == "length"
    finally:
        codes = cluster.stop()
    assert all(code == 0 for code in codes.values()), codes


def test_an_idle_socket_is_closed_after_websocket_idle_timeout_s_but_not_while_a_request_runs(slow_cluster, script):
    idle_timeout_s = 0.2
    # The script's tokens, one a step after the first: the request runs longer than two idle timeouts.
    assert (len(script) - 1) * SLOW_TOKEN_INTERVAL_S > 2 * idle_timeout_s
    proxy, _ = slow_cluster(http={"websocket_idle_timeout_s": idle_timeout_s})
    with connect(socket_url(proxy.url)) as socket:
        socket.send(request("a"))
        assert text(frames_until_done(socket, {"a"})["a"]) == SCRIPT_TEXT  # the socket stayed open throughout
        with pytest.raises(ConnectionClosedOK):
            socket.recv(timeout=10)
    assert socket.close_code == 1000
