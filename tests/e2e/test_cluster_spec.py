"""Speculative decoding through the whole disaggregated cluster.

prefill worker -> KV pages over NIXL (or ZeroMQ where NIXL is absent) ->
decode worker speculating with n-gram lookups -> proxy. Greedy output must
equal the single-process engine without speculation, the decode worker's
Prometheus counters must show drafts accepted, and no page may stay in use.
"""
import asyncio
import json
from importlib import resources

import httpx
import pytest

from common.cli.local_cluster import LocalCluster
from common.config.base import EngineConfig
from common.engine.llm_engine import LLMEngine
from common.protocol.sampling_params import SamplingParams
from kv_transfer.factory import default_backend_name
from tests.conditions import settle
from tests.e2e.fault_scenarios import check_pages_freed

MODEL = "SmolLM2-135M-Instruct"
MAX_TOKENS = 48
# Bounds a wait for a worker's next turn of its loop (at least every idle_poll_s), after which its /metrics show
# that turn's counts; never a timing.
WORKER_TURN_S = 30.0


@pytest.fixture(scope="module")
def prompts():
    prompt_set = json.loads(resources.files("bench.loadgen").joinpath("prompt_set.json").read_text())
    copy = [f"{prompt_set['copy_instructions'][0]}\n\n{p}" for p in prompt_set["passages"][:4]]
    return copy + [p["prompt"] for p in prompt_set["prompts"][:4]]


@pytest.fixture(scope="module")
def reference(embedded_model_dir, prompts):
    engine = LLMEngine(EngineConfig(model=str(embedded_model_dir), num_kv_blocks=512))
    chats = [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    outs = engine.generate(chats, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    return [o.outputs[0].text for o in outs]


@pytest.fixture(scope="module")
def cluster(embedded_model_dir, tmp_path_factory):
    backend = default_backend_name()
    c = LocalCluster.for_tests(embedded_model_dir, tmp_path_factory.mktemp("logs-spec"), transfer_backend=backend,
                worker_overrides=["engine.spec.method=ngram", "engine.spec.max_batch_size=16"]).start()
    yield c
    codes = c.stop()
    assert all(code == 0 for code in codes.values()), codes


def worker_metric(cluster, worker, name):
    return sum(cluster.metric(name, base=cluster.worker_url(worker)).values())


def test_greedy_output_with_speculation_equals_the_plain_engine(cluster, prompts, reference):
    async def run():
        async with httpx.AsyncClient(timeout=300) as client:
            bodies = [{"model": MODEL, "messages": [{"role": "user", "content": p}], "max_tokens": MAX_TOKENS,
                       "temperature": 0.0} for p in prompts]
            return await asyncio.gather(*(client.post(cluster.url + "/v1/chat/completions", json=b) for b in bodies))

    responses = asyncio.run(run())
    assert [r.json()["choices"][0]["message"]["content"] for r in responses] == reference
    assert sum(cluster.metric("tessera_proxy_kv_transfer_bytes_total").values()) > 0, "pages crossed workers"

    def spec_counts() -> tuple[float, float]:  # the decode worker publishes them after each turn of its loop
        return tuple(worker_metric(cluster, "decode-0", f"tessera_spec_decode_num_{kind}_tokens_total")
                     for kind in ("draft", "accepted"))
    drafted, accepted = settle(spec_counts, lambda counts: counts[1] > 0, WORKER_TURN_S,
                               "decode-0 reports drafts accepted (after a turn of its loop: idle_poll_s)")
    assert accepted <= drafted
    check_pages_freed(cluster)


def test_a_request_can_opt_out_or_ask_for_an_unavailable_method(cluster, prompts):
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompts[0]}], "max_tokens": 8,
            "temperature": 0.0, "speculative": "off"}
    resp = httpx.post(cluster.url + "/v1/chat/completions", json=body, timeout=120)
    assert resp.status_code == 200 and resp.json()["choices"][0]["message"]["content"]
    resp = httpx.post(cluster.url + "/v1/chat/completions", json={**body, "speculative": "draft"}, timeout=120)
    assert resp.status_code == 400, resp.text
    assert "draft" in resp.json()["error"]["message"]
