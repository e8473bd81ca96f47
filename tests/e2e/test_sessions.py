"""A conversation's turns through the whole cluster: with a session, each turn goes back to the decode worker
holding the history and prefills only what is new; the output stays the single-process engine's."""
from __future__ import annotations

import httpx
import pytest

from common.cli.local_cluster import LocalCluster
from common.config.roles import ProxyConfig
from tests.conditions import settle
from tests.e2e.chat_reference import assert_replies_are_the_engines

MESSAGES = ["Tell me a long story about a lighthouse keeper and the sea.", "What happened next?",
            "And how did it end?", "Give it a title."]
MAX_TOKENS = 24
# Bounds a wait for a worker's next turn of its loop (at least every idle_poll_s), after which its /metrics show
# that turn's counts; never a timing.
WORKER_TURN_S = 30.0


@pytest.fixture(scope="module")
def cluster(embedded_model_dir, tmp_path_factory):
    """The embedded model: its replies are text that tokenizes back into the tokens generated (a random tiny
    model's need not), so the history a client sends back matches what the worker cached."""
    c = LocalCluster.for_tests(embedded_model_dir, tmp_path_factory.mktemp("session-logs"), prefill=1,
                               decode=2).start()
    yield c
    codes = c.stop()
    assert all(code == 0 for code in codes.values()), codes


def converse(cluster, session: str | None) -> list[dict]:
    history, answers = [], []
    headers = {"X-Session-Id": session} if session else {}
    with httpx.Client(base_url=cluster.url, timeout=120) as client:
        for text in MESSAGES:
            history.append({"role": "user", "content": text})
            body = {"model": "SmolLM2-135M-Instruct", "messages": history, "max_tokens": MAX_TOKENS,
                    "temperature": 0}
            answer = client.post("/v1/chat/completions", json=body, headers=headers).json()
            history.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
            answers.append(answer)
    return answers


def cached(answers: list[dict]) -> list[int]:
    return [a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers]


def test_a_sessions_turns_reuse_the_history_on_one_decode_worker(cluster, embedded_model_dir):
    """Cached tokens come from full blocks of what the worker computed, up to where the history a client sends
    back tokenizes differently from the tokens generated (a reply's leading newline merges with the template's);
    with a session the reply's blocks count, without one only the previous prompt's can (the prefill worker
    never computed the reply)."""
    without = converse(cluster, None)
    before = cluster.metric("tessera_proxy_worker_requests_total")  # counted as each request is sent
    answers = converse(cluster, "chat-1")
    after = cluster.metric("tessera_proxy_worker_requests_total")
    decoded = {k: after[k] - before.get(k, 0) for k in after if 'stage="decode"' in k and after[k] > before.get(k, 0)}
    assert list(decoded.values()) == [len(MESSAGES)], decoded  # every turn on one decode worker
    assert all(with_ >= plain for with_, plain in zip(cached(answers), cached(without)))
    assert any(a["usage"]["prompt_tokens_details"]["cached_tokens"] > p["usage"]["prompt_tokens"]
               for p, a in zip(answers, answers[1:]))  # a reply's blocks reused
    for previous, answer in zip(without, without[1:]):
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] <= previous["usage"]["prompt_tokens"]
    assert_replies_are_the_engines(embedded_model_dir, MESSAGES, answers, MAX_TOKENS)


def test_a_host_tier_under_a_pool_too_small_for_the_sessions_leaks_no_page(tiny_chat_model_dir, tmp_path):
    """Six conversations whose histories outgrow the decode worker's 24-block pool, their turns interleaved: the
    host tier takes what the pool evicts and gives it back; afterwards no pool page is held, and the host tier
    holds no more than it may."""
    cluster = LocalCluster.for_tests(
        tiny_chat_model_dir, tmp_path, prefill=1, decode=1,
        role_overrides=["decode:engine.num_kv_blocks=24", "decode:engine.kv_tiers.host_memory_bytes=16777216"],
    ).start()
    try:
        histories = [[] for _ in range(6)]
        with httpx.Client(base_url=cluster.url, timeout=120) as client:
            for turn in range(4):
                for k, history in enumerate(histories):
                    history.append({"role": "user", "content": f"conversation {k}, turn {turn}: go on"})
                    body = {"model": "SmolLM2-135M-Instruct", "messages": history, "max_tokens": 8,
                            "temperature": 0, "ignore_eos": True}
                    response = client.post("/v1/chat/completions", json=body, headers={"X-Session-Id": f"s{k}"})
                    assert response.status_code == 200, response.text
                    history.append({"role": "assistant",
                                    "content": response.json()["choices"][0]["message"]["content"]})
        decode = cluster.worker_url("decode-0")

        def host_tier() -> dict[str, float]:  # published by the worker after each turn of its loop
            return {name: sum(cluster.metric(name, decode).values()) for name in (
                "tessera_worker_kv_host_pages", "tessera_worker_kv_host_pages_used",
                "tessera_worker_kv_host_copies_out_total", "tessera_worker_kv_host_copies_in_total")}
        host = settle(host_tier, lambda host: host["tessera_worker_kv_host_copies_in_total"] > 0, WORKER_TURN_S,
                      "decode-0's host tier gave pages back (after a turn of its loop: idle_poll_s)")
        assert host["tessera_worker_kv_host_copies_out_total"] > 0
        assert 0 < host["tessera_worker_kv_host_pages_used"] <= host["tessera_worker_kv_host_pages"]
        for worker in ("prefill-0", "decode-0"):
            settle(lambda w=worker: sum(cluster.metric("tessera_worker_kv_pages_used", cluster.worker_url(w)).values()),
                   lambda used: used == 0, ProxyConfig().kv_lease_s,
                   f"{worker} holds no KV page once every request ended (kv_lease_s at the latest)")
    finally:
        codes = cluster.stop()
    assert all(code == 0 for code in codes.values()), codes
