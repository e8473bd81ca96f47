"""The prefill gate (proxy/control/prefill_gate.py) on real clusters, the adaptive controller's and the proxy's own
(``prefill_gate_max_hold_s``): real workers say over the wire which cores they share, and with ``tessera up``'s
layout (prefill and decode workers time-sharing the cores) a prompt waits at the proxy while a sequence decoding
beside it has no room for it in its TPOT target; with workers on cores of their own, nothing is held.

The TPOT target here (0.01 ms) is one no sequence can meet, so that the gate's answer does not depend on how
fast this machine is: every decoding sequence has less slack than any prompt costs. At that target the TPOT cap
gives each decode worker one slot, so the cluster has two decode workers: the stream holds one slot and the
second request finds the other free, so it is the gate that holds it, not the cap (with one slot, the gate is
asked only once the stream is predicted to end within one prefill, a window of a token or two). The workers
calibrate their step models at start, as shipped (``engine.steps.calibration_s``), so the gate can weigh from the
first request. What it holds under a real target and load is bench/tac_goodput.py's (docs/benchmarks.md)."""
from __future__ import annotations

import hashlib
import threading

import httpx
import pytest

from common.cli.local_cluster import LocalCluster, post_json
from common.config.roles import ProxyConfig, WorkerConfig
from common.runtime.prometheus_text import total
from tests.conditions import settle

ADMIN_KEY = "prefill-gate-admin-key"
GATES = {  # which gate: its settings, and the counter of the prompts it held
    "tac": (["slo.tac_enabled=true", "slo.ttft_slo_ms=60000", "slo.tpot_slo_ms=0.01"], "tessera_tac_prefill_held_total"),
    "proxy": (["slo.prefill_gate_max_hold_s=0.5", "slo.tpot_slo_scope=always", "slo.tpot_slo_ms=0.01"],
              "tessera_proxy_prefill_held_total"),
}


def start(model_dir, log_dir, shared: bool, overrides: list[str]) -> LocalCluster:
    options = {"threads": 0, "share_cores": True} if shared else {"threads": 1}
    admin = f"security.admin_api_key_sha256={hashlib.sha256(ADMIN_KEY.encode()).hexdigest()}"
    calibration = f"engine.steps.calibration_s={WorkerConfig().engine.steps.calibration_s}"  # the shipped default
    return LocalCluster.for_tests(model_dir, log_dir, transfer_backend="zmq", decode=2,
                                  proxy_overrides=[*overrides, admin], worker_overrides=[calibration],
                                  **options).start()


def step_models_known(cluster: LocalCluster) -> None:
    """Until the proxy holds every worker's step model (each calibrated before it registered, and sent with its
    heartbeats)."""
    def rows() -> list[dict]:
        resp = httpx.get(cluster.url + "/admin/workers", headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                         timeout=10)
        return resp.json()["data"]

    settle(rows, lambda workers: len(workers) == cluster.num_workers and all(w["step_model"] for w in workers),
           ProxyConfig().heartbeat_timeout_s, "every worker's step model reaches the proxy with a heartbeat "
           "(heartbeat_timeout_s)")


def held(cluster: LocalCluster, counter: str) -> float:
    return total(httpx.get(cluster.url + "/metrics", timeout=10).text, counter)


def decode_beside(cluster: LocalCluster, model: str) -> list[str]:
    """A long stream decodes; after its first tokens another request comes. Which of them ended ("stream",
    "other"), in the order they ended."""
    ended: list[str] = []

    def other() -> None:
        status, body = post_json(cluster.url + "/v1/completions", {
            "model": model, "prompt": "another prompt " * 8, "max_tokens": 2, "ignore_eos": True})
        assert status == 200, body
        ended.append("other")

    body = {"model": model, "prompt": "a long story " * 4, "max_tokens": 160, "ignore_eos": True, "stream": True}
    waiter = threading.Thread(target=other)
    with httpx.stream("POST", cluster.url + "/v1/completions", json=body, timeout=120) as resp:
        for i, line in enumerate(resp.iter_lines()):
            if i == 3:
                waiter.start()
            if line == "data: [DONE]":
                ended.append("stream")
    waiter.join(timeout=120)
    return ended


@pytest.mark.parametrize("gate", list(GATES))
@pytest.mark.parametrize("shared", [True, False], ids=["shared-cores", "own-cores"])
def test_a_prompt_waits_for_a_sequence_decoding_on_the_same_cores(tiny_chat_model_dir, tmp_path, shared, gate):
    overrides, counter = GATES[gate]
    cluster = start(tiny_chat_model_dir, tmp_path, shared, overrides)
    try:
        model = httpx.get(cluster.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        step_models_known(cluster)
        before = held(cluster, counter)
        ended = decode_beside(cluster, model)
        if shared:  # counted as the gate holds the prompt, before it goes: final once its answer came
            assert held(cluster, counter) > before  # the gate weighed the stream's slack against the prompt: no
        else:
            assert held(cluster, counter) == 0  # no cores shared: no prompt is ever held
        assert sorted(ended) == ["other", "stream"]  # both served; the other request was not lost while it waited
    finally:
        codes = cluster.stop()
    assert all(code == 0 for code in codes.values()), codes
