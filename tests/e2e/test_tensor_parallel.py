"""Tensor parallelism through the cluster: prefill and decode at different parallelism exchange pages and answer as
transformers does; a rank killed under load takes its worker with it while every request finishes elsewhere, and a
TP 1 decode worker's streams move to a TP 3 one unchanged; a worker at TP 2 swaps its model and back, its old
ranks exiting each time."""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time

import httpx
import psutil
import pytest
import torch
from transformers import AutoModelForCausalLM

from common.cli.local_cluster import LocalCluster
from common.config.base import CpuConfig, EngineConfig
from common.engine.llm_engine import LLMEngine
from common.protocol.sampling_params import SamplingParams, StructuredOutput
from bench.structured_schemas import prompt, schemas
from tests.e2e.fault_scenarios import (
    check_nothing_lost, check_pages_freed, completion_bodies, no_fault_run, run_scenario, send_signal, wait_until,
)
from tests.e2e.test_cluster import MAX_TOKENS, MODEL, PROMPTS
from tests.e2e.test_hot_cold_models import models, until_served  # noqa: F401 -- models: a fixture
from tests.e2e.test_structured_outputs import schema_body

pytestmark = pytest.mark.slow
TP = 3  # the short model's (the embedded model's) 9 heads and 3 KV heads split three ways
KILL_PROMPTS, KILL_TOKENS = 8, 32
SCHEMA_TOKENS = 40


def complete(url: str, prompts: list[str], max_tokens: int = MAX_TOKENS) -> list[httpx.Response]:
    async def run():
        async with httpx.AsyncClient(timeout=300) as client:
            return await asyncio.gather(*(client.post(url + "/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": p}], "max_tokens": max_tokens,
                "temperature": 0.0}) for p in prompts))
    return asyncio.run(run())


@pytest.fixture(scope="module")
def reference(short_model_dir):
    """The single-process engine's greedy chat answers, each checked token for token against transformers'."""
    engine = LLMEngine(EngineConfig(model=str(short_model_dir), num_kv_blocks=256, cpu=CpuConfig(huge_pages=False)))
    chats = [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    short = engine.generate(chats, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    # Each answer is transformers' greedy one: one forward pass over the chat and the answer (teacher forcing)
    # picks every answer token, EOS included, as its argmax (what its generate() would, a step at a time).
    hf = AutoModelForCausalLM.from_pretrained(short_model_dir, dtype=torch.float32).eval()
    for ids, out in zip(chats, short):
        answer = list(out.outputs[0].token_ids)
        with torch.inference_mode():
            logits = hf(torch.tensor([ids + answer])).logits[0, len(ids) - 1:len(ids) + len(answer) - 1]
        assert logits.argmax(-1).tolist() == answer
    # the rank-kill test's answers: long enough that the kill lands mid-decode (the engine's own greedy output,
    # which the check above ties to transformers')
    long = engine.generate(chats[:KILL_PROMPTS], SamplingParams(temperature=0.0, max_tokens=KILL_TOKENS))
    return {"short": [o.outputs[0].text for o in short], "long": [o.outputs[0].text for o in long]}


@pytest.fixture(scope="module", params=["decode", "prefill"])
def tp_cluster(request, short_model_dir, tmp_path_factory):
    """The short model with the ``request.param`` worker at TP 3 and the other at TP 1."""
    c = LocalCluster.for_tests(short_model_dir, tmp_path_factory.mktemp(f"tp-{request.param}"),
                               role_overrides=[f"{request.param}:engine.tensor_parallel_size={TP}"]).start()
    yield c
    codes = c.stop()
    assert all(code == 0 for code in codes.values()), codes


def test_greedy_chat_at_tp3_equals_transformers(tp_cluster, reference):
    responses = complete(tp_cluster.url, PROMPTS)
    assert [r.status_code for r in responses] == [200] * len(PROMPTS)
    assert [r.json()["choices"][0]["message"]["content"] for r in responses] == reference["short"]
    check_pages_freed(tp_cluster)
    transferred = tp_cluster.metric("tessera_proxy_kv_transfer_bytes_total")
    assert sum(transferred.values()) > 0, "the pages moved between the two parallelisms"


@pytest.fixture(scope="module")
def constrained(short_model_dir):
    """Two JSON-schema chat requests (greedy, cut at SCHEMA_TOKENS) and the single-process engine's answers."""
    cases = schemas(2)
    engine = LLMEngine(EngineConfig(model=str(short_model_dir), num_kv_blocks=256, cpu=CpuConfig(huge_pages=False)))
    chats = [engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt(i)}]) for i in range(2)]
    params = [SamplingParams(temperature=0.0, max_tokens=SCHEMA_TOKENS, structured=StructuredOutput(
        kind="json_schema", spec=json.dumps(s, separators=(",", ":")))) for s in cases]
    answers = [o.outputs[0].text for o in engine.generate(chats, params)]
    return [schema_body(i, s, temperature=0.0, max_tokens=SCHEMA_TOKENS) for i, s in enumerate(cases)], answers


def test_json_schema_output_at_tp3_equals_the_single_process_engine(tp_cluster, constrained):
    """The prefill worker samples the first token under the constraint, the decode worker the rest: at TP 3 either
    one masks the logits its rank 0 gathered."""
    bodies, answers = constrained
    async def run():
        async with httpx.AsyncClient(base_url=tp_cluster.url, timeout=300) as client:
            return await asyncio.gather(*(client.post("/v1/chat/completions", json=body) for body in bodies))

    responses = asyncio.run(run())
    assert [r.status_code for r in responses] == [200] * len(bodies), [r.text for r in responses]
    assert [r.json()["choices"][0]["message"]["content"] for r in responses] == answers


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _ranks(pid: int) -> list[psutil.Process]:
    """The rank processes (ranks 1..N-1) worker ``pid`` runs now."""
    return [p for p in psutil.Process(pid).children() if "spawn_main" in " ".join(p.cmdline()) and _alive(p.pid)]


def test_a_rank_killed_under_load_ends_its_worker_and_loses_no_request(short_model_dir, tmp_path, reference):
    c = LocalCluster.for_tests(short_model_dir, tmp_path, decode=2,
                               role_overrides=[f"decode-0:engine.tensor_parallel_size={TP}"]).start()
    try:
        worker = psutil.Process(c.procs["decode-0"].pid)
        ranks = [p for p in worker.children() if "spawn_main" in " ".join(p.cmdline())]
        assert len(ranks) == TP - 1, [p.cmdline() for p in worker.children()]
        prompts = PROMPTS[:KILL_PROMPTS]

        async def load():
            async with httpx.AsyncClient(timeout=300) as client:
                calls = [asyncio.create_task(client.post(c.url + "/v1/chat/completions", json={
                    "model": MODEL, "messages": [{"role": "user", "content": p}], "max_tokens": KILL_TOKENS,
                    "temperature": 0.0})) for p in prompts]
                deadline = time.monotonic() + 120
                metrics = f"http://127.0.0.1:{c.metrics_ports['decode-0']}"
                while not any(v > 0 for v in c.metric("tessera_worker_generation_tokens_total", metrics).values()):
                    assert time.monotonic() < deadline, "decode-0 never generated"
                    await asyncio.sleep(0.05)
                os.kill(ranks[-1].pid, signal.SIGKILL)  # mid-decode: decode-0 holds running requests
                return await asyncio.gather(*calls)

        responses = asyncio.run(load())
        assert [r.status_code for r in responses] == [200] * len(prompts)
        assert [r.json()["choices"][0]["message"]["content"] for r in responses] == reference["long"]
        assert c.procs["decode-0"].wait(timeout=60) != 0  # the worker went with its rank
        rendezvous = re.search(r"rendezvous (\S+)", (tmp_path / "decode-0.log").read_text()).group(1)
        assert not os.path.exists(rendezvous), "the dead group's rendezvous file was left behind"
        deadline = time.monotonic() + 30
        while any(_alive(p.pid) for p in ranks) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(p.pid) for p in ranks), "a rank outlived its worker"
    finally:
        codes = c.stop()
    assert all(code == 0 for name, code in codes.items() if name != "decode-0"), codes


def test_a_split_the_model_refuses_stops_the_worker_and_a_cluster_that_never_started_leaves_nothing(
        short_model_dir, tmp_path):
    """TP 2 on 9 heads: the decode worker exits naming the setting; the cluster's start fails, and stops the rest."""
    c = LocalCluster.for_tests(short_model_dir, tmp_path, role_overrides=["decode:engine.tensor_parallel_size=2"])
    with pytest.raises(RuntimeError, match="cluster processes exited"):
        c.start(timeout=300)
    assert all(proc.poll() is not None for proc in c.procs.values()), "a process outlived the failed start"
    assert "engine.tensor_parallel_size 2 does not divide" in (tmp_path / "decode-0.log").read_text()


def test_streams_of_a_tp1_decode_worker_killed_mid_stream_finish_unchanged_on_a_tp3_one(short_model_dir, tmp_path):
    """decode-1 (TP 1) is killed while it streams: its requests resume on decode-0 (TP 3), whose re-prefilled pages
    come from the TP 1 prefill worker, and every greedy stream ends as it did without the fault."""
    bodies = [{**body, "temperature": 0.0} for body in completion_bodies(6, 32)]
    c = LocalCluster.for_tests(short_model_dir, tmp_path, decode=2,
                               role_overrides=[f"decode-0:engine.tensor_parallel_size={TP}"]).start()
    ranks = []
    try:
        reference = no_fault_run(c, bodies)
        metrics = f"http://127.0.0.1:{c.metrics_ports['decode-1']}"

        def streaming(run) -> bool:
            return run.with_text >= 1 and sum(c.metric("tessera_worker_running_sequences", metrics).values()) >= 1

        results, _ = asyncio.run(run_scenario(c, bodies, [wait_until(streaming, "decode-1 streaming", 120),
                                                          send_signal("decode-1", signal.SIGKILL)]))
        check_nothing_lost(results, reference, bodies)
        assert sum(c.metric("tessera_proxy_migrations_total").values()) >= 1, "a stream resumed off decode-1"
        check_pages_freed(c)
        ranks = _ranks(c.procs["decode-0"].pid)
        assert len(ranks) == TP - 1
    finally:
        codes = c.stop()
    assert all(code == 0 for name, code in codes.items() if name != "decode-1"), codes
    assert not any(_alive(p.pid) for p in ranks), "a rank outlived its worker"


def test_a_worker_at_tp2_swaps_its_model_and_back_and_its_old_ranks_exit(models, tmp_path, monkeypatch):
    """The decode worker at TP 2 (the tiny models' 4 heads and 2 KV heads split two ways) with a TP 1 prefill
    worker: each swap closes the old model's ranks and starts new ones, which answer as that model at TP 1 does."""
    cache, answers = models
    monkeypatch.setenv("TESSERA_CACHE_DIR", str(cache))
    (tmp_path / "logs").mkdir()
    c = LocalCluster.for_tests("tiny@v1", tmp_path / "logs", worker_overrides=["standby_models=[other@v1]"],
                               role_overrides=["decode:engine.tensor_parallel_size=2"],
                               proxy_overrides=["model_swap_min_idle_s=1"]).start()
    seen = []
    try:
        with httpx.Client(base_url=c.url, timeout=60) as client:
            for model in ("tiny", "other", "tiny"):
                served, _, _ = until_served(client, model)
                assert served.json()["choices"][0]["message"]["content"] == answers[model], model
                ranks = _ranks(c.procs["decode-0"].pid)
                assert len(ranks) == 1, [p.cmdline() for p in ranks]
                assert not any(_alive(p.pid) for p in seen), f"the ranks before {model} outlived their model"
                seen += ranks
        assert len({p.pid for p in seen}) == 3, "each model loaded got ranks of its own"
    finally:
        codes = c.stop()
    assert all(code == 0 for code in codes.values()), codes
    assert not any(_alive(p.pid) for p in seen), "a rank outlived its worker"
    assert "other@v1 loaded in" in (tmp_path / "logs" / "decode-0.log").read_text()
