"""Hot and cold models through real processes, in the shipped disaggregated layout (a prefill and a decode worker).

Both workers start on ``tiny`` and offer ``other`` (``standby_models``). The first request for ``other`` gets 503
with Retry-After; once ``tiny`` had no request for ``model_swap_min_idle_s`` the proxy asks both workers to swap,
and ``other`` then serves its own greedy output (two tiny random models: a response equal to a model's reference
was computed by that model alone). After ``model_idle_unload_s`` without a request both workers unload and stand
by; a request for ``tiny`` loads it again. The load times are reported (``-s`` shows them) and exported.
"""
from __future__ import annotations

import time

import httpx
import pytest

from common.cli.local_cluster import LocalCluster
from common.config.roles import ProxyConfig
from tests.conditions import settle
from tests.tiny_models import registered_versions

PROMPT = "Tell me about the sea."
MAX_TOKENS = 12
IDLE_S = 6
LOAD_TIMEOUT_S = ProxyConfig().model_load_timeout_s  # how long the proxy waits for a worker's load


@pytest.fixture(scope="module")
def models(tmp_path_factory, embedded_model_dir):
    """tiny@v1 and other@v1 in a registry of their own, and each one's greedy answer to ``PROMPT``."""
    cache, by_model = registered_versions(tmp_path_factory.mktemp("hot-cold"), [("tiny@v1", 1), ("other@v1", 2)],
                                          [PROMPT], MAX_TOKENS, embedded_model_dir)
    answers = {model.partition("@")[0]: texts[PROMPT] for model, texts in by_model.items()}
    assert answers["tiny"] != answers["other"]
    return cache, answers


def ask(client: httpx.Client, model: str) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True}
    return client.post("/v1/chat/completions", json=body)


def until_served(client: httpx.Client, model: str, timeout: float = 120) -> tuple[httpx.Response, int, float]:
    """The first 200 for ``model``, how many 503s came before it, and the seconds from the first request."""
    started, refused = time.monotonic(), 0
    while True:
        response = ask(client, model)
        if response.status_code == 200:
            return response, refused, time.monotonic() - started
        assert response.status_code == 503, response.text
        assert response.json()["error"]["code"] == "model_not_loaded" and int(response.headers["Retry-After"]) >= 1, \
            response.text
        refused += 1
        assert time.monotonic() - started < timeout, f"{model} did not load within {timeout}s"
        time.sleep(min(int(response.headers["Retry-After"]), 0.5))


def entries(client: httpx.Client) -> dict[str, dict]:
    return {m["id"]: m for m in client.get("/v1/models").json()["data"]}


def test_a_cold_model_loads_on_demand_and_an_idle_one_unloads(models, tmp_path, monkeypatch):
    cache, answers = models
    monkeypatch.setenv("TESSERA_CACHE_DIR", str(cache))
    (tmp_path / "logs").mkdir()
    cluster = LocalCluster.for_tests(
        "tiny@v1", tmp_path / "logs", prefill=1, decode=1,
        worker_overrides=["standby_models=[other@v1]", f"model_idle_unload_s={IDLE_S}"]).start()
    try:
        with httpx.Client(base_url=cluster.url, timeout=60) as client:
            # On a loaded machine the cluster may take longer than model_idle_unload_s to be ready, and a worker
            # that served nothing for that long has unloaded tiny already: then its first request loads it again.
            first, _, _ = until_served(client, "tiny")
            assert first.json()["choices"][0]["message"]["content"] == answers["tiny"]
            settle(lambda: entries(client), lambda listed: [v["workers"] for v in listed["tiny"]["versions"]] == [2],
                   LOAD_TIMEOUT_S, "/v1/models lists tiny@v1 on both workers (model_load_timeout_s)")
            # Its workers served tiny a moment ago: they give it up once no request chose it for
            # model_swap_min_idle_s (5 s), and other@v1 is loading from then on.
            cold = ask(client, "other")
            assert cold.status_code == 503 and "busy with its own model" in cold.json()["error"]["message"]
            served, refused, waited = until_served(client, "other")
            assert served.json()["choices"][0]["message"]["content"] == answers["other"]
            assert served.headers["X-Tessera-Model"] == "other@v1"
            # The first 200 needs one worker of each role loaded; each reports its load on its own.
            settle(lambda: cluster.metric("tessera_proxy_model_loads_total"),
                   lambda loads: loads == {'{model="other@v1",outcome="loaded"}': 2.0}, LOAD_TIMEOUT_S,
                   "the prefill and the decode worker both report other@v1 loaded (model_load_timeout_s)")
            listed = settle(lambda: entries(client),
                            lambda listed: [v["workers"] for v in listed["other"]["versions"]] == [2] and
                            listed["tiny"]["versions"] == [], LOAD_TIMEOUT_S,
                            "/v1/models lists other@v1 on both workers (model_load_timeout_s)")
            assert listed["tiny"]["loadable_versions"] == [
                {"version": "v1", "workers": 2, "loading": False, "last_load_s": None}]  # loaded at start
            load_s = cluster.metric("tessera_proxy_model_load_seconds_sum")
            print(f"\nother@v1: served {waited:.2f}s after its first request ({refused + 1} answered 503), "
                  f"two workers' loads took {sum(load_s.values()):.2f}s together")

            # Idle: both workers unload and stand by, offering both models; the next request loads one again.
            # Each says Goodbye, then Standby.
            deadline = time.monotonic() + IDLE_S + 30
            while sum(cluster.metric("tessera_proxy_workers_alive").values()) > 0 or [
                    v["workers"] for v in entries(client).get("other", {}).get("loadable_versions", [])] != [2]:
                assert time.monotonic() < deadline, f"the idle workers did not unload and stand by: {entries(client)}"
                time.sleep(0.5)
            assert entries(client)["other"]["versions"] == []
            again, refused, waited = until_served(client, "tiny")
            assert refused >= 1 and again.json()["choices"][0]["message"]["content"] == answers["tiny"]
            print(f"tiny@v1 from standby: served {waited:.2f}s after its first request")
    finally:
        codes = cluster.stop()
    assert all(code == 0 for code in codes.values()), codes
    decode_log = (tmp_path / "logs" / "decode-0.log").read_text()
    assert "unloading" in decode_log and "other@v1 loaded in" in decode_log
