"""The pipelined KV hand-off through real processes: the decode worker pulls each layer group of a prompt chunk as
the prefill worker computes it (``kv_pipeline.min_tokens`` low, so that every prompt here takes it).

A plain cluster (no pipelining) gives the reference streams; the pipelined cluster must give them token for token,
with every hand-off pipelined and pages pulled while the prompts were computed, and no page left in use after. A
prefill worker killed while it computes a prompt loses nothing: the decode worker frees what it reserved (the proxy
aborts the pipelined hand-off there) and the prompt resumes on the other prefill worker.
"""
from __future__ import annotations

import asyncio

import pytest

from common.cli.local_cluster import LocalCluster
from tests.e2e.fault_scenarios import (check_nothing_lost, check_pages_freed, completion_bodies,
                                       kill_mid_prefill, run_scenario, in_order)

STREAMS = 8
MAX_TOKENS = 16
PROMPT = "The lighthouse keeper counted the ships that passed the harbour at night, one by one, and wrote them down. "
BODIES = completion_bodies(STREAMS, MAX_TOKENS, lambda i: f"Log {i}: " + PROMPT * 8)  # about 180 tokens each
# Chunks of 64 tokens: each prompt reports layer groups of three chunks or more.
WORKERS = ["prefill:engine.max_num_batched_tokens=64"]
PIPELINE = ["kv_pipeline.min_tokens=64", "kv_pipeline.layer_groups=4", "heartbeat_timeout_s=2"]


def total(cluster: LocalCluster, name: str, base: str | None = None, label: str = "") -> float:
    return sum(v for labels, v in cluster.metric(name, base).items() if label in labels)


@pytest.fixture(scope="module")
def reference(short_model_dir, tmp_path_factory):
    """The streams of BODIES through a cluster that pulls the pages after the first token."""
    plain = LocalCluster.for_tests(short_model_dir, tmp_path_factory.mktemp("plain-handoff"), prefill=1, decode=1,
                                   role_overrides=WORKERS).start()
    try:
        results, _ = asyncio.run(run_scenario(plain, BODIES))
    finally:
        plain.stop()
    streams = in_order(results)
    assert all(not s.lost and s.completion_tokens == MAX_TOKENS for s in streams), streams
    return streams


@pytest.fixture(scope="module")
def cluster(short_model_dir, tmp_path_factory):
    c = LocalCluster.for_tests(short_model_dir, tmp_path_factory.mktemp("kv-pipeline"), prefill=2, decode=1,
                               proxy_overrides=PIPELINE, role_overrides=WORKERS).start()
    yield c
    c.stop()


def test_pipelined_hand_offs_give_the_plain_streams(cluster, reference):
    results, _ = asyncio.run(run_scenario(cluster, BODIES))
    check_nothing_lost(results, reference, BODIES)
    assert total(cluster, "tessera_proxy_kv_pipelined_total") == STREAMS
    decode = cluster.worker_url("decode-0")
    assert total(cluster, "tessera_worker_kv_pipelined_pulls_total", decode, 'outcome="ok"') == STREAMS
    assert total(cluster, "tessera_worker_kv_pipelined_bytes_total", decode, "during_prefill") > 0
    assert total(cluster, "tessera_worker_kv_pull_outcomes_total", decode, "recomputed") == 0
    check_pages_freed(cluster)


def test_a_prefill_worker_killed_mid_prompt_loses_nothing(cluster, reference):
    _, run = kill_mid_prefill(cluster, BODIES, reference)
    assert run.supervisor.restarts == {run.victims[0]: 1}
    decode = cluster.worker_url("decode-0")
    assert total(cluster, "tessera_worker_kv_pipelined_pulls_total", decode, 'outcome="cancelled"') >= 1
    check_pages_freed(cluster)
