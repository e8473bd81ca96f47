"""Resumable streams (proxy/edge/resumable.py): numbered events, reconnection with Last-Event-ID, the window, the
caps."""
from __future__ import annotations

import json

import httpx

from common.cli.local_cluster import LocalCluster
from common.config.roles import ProxyConfig, TenantConfig
from common.protocol.wire import Abort, DecodeRequest
from proxy.tenancy.api_keys import hash_key
from tests.conditions import settle
from tests.e2e.proxy_harness import (  # noqa: F401
    MODEL, PATIENCE_S, SCRIPT_TEXT, assert_openai_error, make_proxy, make_worker, ready, script, slow_cluster,
    tokenizer,
)

RESUMABLE = {"X-Resumable": "true"}


def body(**fields) -> dict:
    return {"model": MODEL, "prompt": "Hi", "max_tokens": 50, "stream": True, **fields}


def parse(raw: str) -> list[tuple[int | None, str]]:
    """(event number or None, data) of each event of an SSE body (an id ``N.T``'s N)."""
    events = []
    for block in raw.split("\n\n"):
        if not block:
            continue
        fields = dict(line.split(": ", 1) for line in block.split("\n"))
        events.append((int(fields["id"].partition(".")[0]) if "id" in fields else None, fields["data"]))
    return events


def text_of(events: list[tuple[int | None, str]]) -> str:
    """The choices' texts, one after the other."""
    texts: dict[int, str] = {}
    for _, data in events:
        if data != "[DONE]":
            for choice in json.loads(data).get("choices", []):
                texts[choice["index"]] = texts.get(choice["index"], "") + (choice.get("text") or "")
    return "".join(texts[i] for i in sorted(texts))


def read_some(lines, count: int) -> list[tuple[int | None, str]]:
    """The next ``count`` events from an open response's ``iter_lines()``."""
    return read_ids(lines, count)[0]


def read_ids(lines, count: int) -> tuple[list[tuple[int | None, str]], str | None]:
    """The next ``count`` events (``read_some``) and the last one's whole id (``N.T``)."""
    events, block, last = [], [], None
    for line in lines:
        if line.startswith("id: "):
            last = line[4:]
        if line:
            block.append(line)
            continue
        events += parse("\n".join(block) + "\n\n")
        block = []
        if len(events) == count:
            return events, last
    raise AssertionError(f"the stream ended after {len(events)} events")


def test_every_event_of_a_resumable_stream_is_numbered_and_the_response_names_itself(slow_cluster):
    proxy, _ = slow_cluster()
    response = proxy.http.post("/v1/completions", json=body(n=2), headers=RESUMABLE)
    assert response.status_code == 200
    events = parse(response.text)
    assert [number for number, _ in events] == list(range(len(events)))
    assert events[-1][1] == "[DONE]"
    response_id = response.headers["x-response-id"]
    assert all(json.loads(data)["id"] == response_id for _, data in events[:-1])
    assert text_of(events) == SCRIPT_TEXT * 2  # both choices, one id per event
    plain = proxy.http.post("/v1/completions", json=body())
    assert all(number is None for number, _ in parse(plain.text)), "ids only where asked for"


def test_a_client_that_leaves_and_comes_back_gets_every_event_after_its_last(slow_cluster):
    proxy, decode = slow_cluster()
    whole = parse(proxy.http.post("/v1/completions", json=body(), headers=RESUMABLE).text)
    with proxy.http.stream("POST", "/v1/completions", json=body(), headers=RESUMABLE) as response:
        response_id = response.headers["x-response-id"]
        first = read_some(response.iter_lines(), 3)
    # Away: the request runs on (no Abort), and its events are kept.
    resumed = proxy.http.get(f"/v1/streams/{response_id}", headers={"Last-Event-ID": str(first[-1][0])})
    assert resumed.status_code == 200
    rest = parse(resumed.text)
    assert [n for n, _ in first + rest] == list(range(len(first) + len(rest)))
    assert text_of(first + rest) == text_of(whole) == SCRIPT_TEXT
    assert rest[-1][1] == "[DONE]"
    assert not decode.messages(Abort)
    metrics = proxy.http.get("/metrics").text
    assert "tessera_proxy_resumed_streams_total 1.0" in metrics
    # Finished, the stream is still there for the window: a client that missed the end reads it again.
    again = parse(proxy.http.get(f"/v1/streams/{response_id}?last_event_id=-1").text)
    assert again == first + rest


def test_nobody_coming_back_within_the_window_cancels_the_request(slow_cluster):
    proxy, decode = slow_cluster(requests={"resume_window_s": 0.3})
    with proxy.http.stream("POST", "/v1/completions", json=body(max_tokens=2000), headers=RESUMABLE) as response:
        response_id = response.headers["x-response-id"]
        read_some(response.iter_lines(), 2)
    decode.wait_for(lambda m: isinstance(m, Abort), timeout=10)
    settle(lambda: dict(proxy.services.cluster.inflight), lambda inflight: not inflight, PATIENCE_S,
           "the request nobody came back for leaves the proxy")
    gone = settle(lambda: proxy.http.get(f"/v1/streams/{response_id}"), lambda r: r.status_code == 404, PATIENCE_S,
                  "the stream goes once requests.resume_window_s=0.3 passed")
    assert_openai_error(gone, 404, "resume_window_s")
    settle(lambda: proxy.http.get("/metrics").text, lambda text: "tessera_proxy_resume_buffer_bytes 0.0" in text,
           PATIENCE_S, "the stream's buffer is freed with it (resume_window_s)")


def test_a_client_without_resume_still_aborts_at_once(slow_cluster):
    proxy, decode = slow_cluster(requests={"resume_window_s": 600})
    with proxy.http.stream("POST", "/v1/completions", json=body(max_tokens=2000)) as response:
        read_some(response.iter_lines(), 2)
    decode.wait_for(lambda m: isinstance(m, Abort), timeout=10)


def test_a_second_reader_takes_the_stream_over(slow_cluster):
    proxy, _ = slow_cluster()
    with proxy.http.stream("POST", "/v1/completions", json=body(), headers=RESUMABLE) as first:
        response_id = first.headers["x-response-id"]
        lines = first.iter_lines()
        seen = read_some(lines, 2)
        taken = proxy.http.get(f"/v1/streams/{response_id}", headers={"Last-Event-ID": str(seen[-1][0])})
        rest_of_first = list(lines)
    events = parse(taken.text)
    assert events[-1][1] == "[DONE]"
    assert text_of(seen + events) == SCRIPT_TEXT
    assert "data: [DONE]" not in rest_of_first, "the first reader ended when it was replaced"


def test_reconnection_errors_name_what_is_wrong(slow_cluster, make_proxy):
    proxy, _ = slow_cluster(requests={"resume_buffer_events": 4})
    response = proxy.http.post("/v1/completions", json=body(), headers=RESUMABLE)
    response_id, last = response.headers["x-response-id"], parse(response.text)[-1][0]
    assert last > 4
    assert_openai_error(proxy.http.get(f"/v1/streams/{response_id}", headers={"Last-Event-ID": "0"}), 404,
                        "requests.resume_buffer_events=4")
    assert_openai_error(proxy.http.get(f"/v1/streams/{response_id}", headers={"Last-Event-ID": str(last + 1)}),
                        404, "not available")
    kept = parse(proxy.http.get(f"/v1/streams/{response_id}", headers={"Last-Event-ID": str(last - 4)}).text)
    assert [n for n, _ in kept] == list(range(last - 3, last + 1))
    error = assert_openai_error(proxy.http.get(f"/v1/streams/{response_id}", headers={"Last-Event-ID": "x"}),
                                400, "Last-Event-ID")
    assert error["param"] == "Last-Event-ID"
    assert_openai_error(proxy.http.get("/v1/streams/cmpl-nope"), 404, "cmpl-nope")
    error = assert_openai_error(proxy.http.post("/v1/completions", json=body(), headers={"X-Resumable": "maybe"}),
                                400, "X-Resumable")
    assert error["param"] == "X-Resumable"


def test_the_global_cap_bounds_the_memory_of_every_stream_together(slow_cluster):
    proxy, _ = slow_cluster(requests={"resume_buffer_bytes": 600})
    for _ in range(3):
        response = proxy.http.post("/v1/completions", json=body(), headers=RESUMABLE)
        assert text_of(parse(response.text)) == SCRIPT_TEXT  # a connected reader loses nothing
    store = proxy.services.streams
    assert store.size <= 600 + max(len(e) for s in store.streams.values() for _, e in s.events)
    assert store.size == sum(s.size for s in store.streams.values())


def test_a_tenant_can_make_its_streams_resumable_and_only_it_may_resume_them(make_proxy, make_worker):
    keys = {"alice": "sk-alice", "bob": "sk-bob"}
    tenants = (TenantConfig("alice", api_key_sha256=(hash_key(keys["alice"]),), resumable_streams=True),
               TenantConfig("bob", api_key_sha256=(hash_key(keys["bob"]),)))
    proxy = make_proxy(tenancy={"auth_enabled": True, "tenants": tenants})
    make_worker(proxy, "d0", "decode")
    ready(proxy)

    def auth(name: str) -> dict:
        return {"Authorization": f"Bearer {keys[name]}"}

    alice = proxy.http.post("/v1/completions", json=body(), headers=auth("alice"))
    assert parse(alice.text)[0][0] == 0
    response_id = alice.headers["x-response-id"]
    assert_openai_error(proxy.http.get(f"/v1/streams/{response_id}", headers=auth("bob")), 404)
    assert proxy.http.get(f"/v1/streams/{response_id}", headers=auth("alice")).status_code == 200
    opted_out = proxy.http.post("/v1/completions", json=body(), headers={**auth("alice"), "X-Resumable": "false"})
    assert parse(opted_out.text)[0][0] is None
    assert parse(proxy.http.post("/v1/completions", json=body(), headers=auth("bob")).text)[0][0] is None
    assert parse(proxy.http.post("/v1/completions", json=body(), headers={**auth("bob"), **RESUMABLE}).text)[0][0] == 0


def test_the_request_keeps_running_on_its_worker_while_the_client_is_away(slow_cluster):
    proxy, decode = slow_cluster()
    with proxy.http.stream("POST", "/v1/completions", json=body(), headers=RESUMABLE) as response:
        response_id = response.headers["x-response-id"]
        read_some(response.iter_lines(), 2)
    decode.wait_for(lambda m: isinstance(m, DecodeRequest))
    settle(lambda: proxy.services.streams.streams[response_id].finished, bool, PATIENCE_S,
           "the request runs to its end with nobody connected")
    events = parse(proxy.http.get(f"/v1/streams/{response_id}").text)
    assert text_of(events) == SCRIPT_TEXT and not decode.messages(Abort)


def test_a_real_cluster_resumes_a_stream_with_the_text_it_would_have_sent(short_model_dir, tmp_path):
    """The short model, real processes: leave after a few events, come back, and the text equals a whole run."""
    cluster = LocalCluster.for_tests(short_model_dir, tmp_path).start()
    try:
        request = {"model": "SmolLM2-135M-Instruct", "prompt": "The history of the lighthouse", "max_tokens": 48,
                   "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=cluster.url, timeout=120) as client:
            whole = parse(client.post("/v1/completions", json=request).text)
            with client.stream("POST", "/v1/completions", json=request, headers=RESUMABLE) as response:
                response_id = response.headers["x-response-id"]
                first = read_some(response.iter_lines(), 4)
            rest = parse(client.get(f"/v1/streams/{response_id}", headers={"Last-Event-ID": str(first[-1][0])}).text)
        assert text_of(first + rest) == text_of(whole) and len(text_of(whole)) > 40
        assert [n for n, _ in first + rest] == list(range(len(first) + len(rest)))
        settle(lambda: cluster.metric("tessera_proxy_kv_pages_used"), lambda used: not any(used.values()),
               ProxyConfig().kv_lease_s, "every KV page is free, as heartbeats report (kv_lease_s at the latest)")
    finally:
        cluster.stop()
