"""A worker switches roles under load, through real processes (issue 47's check).

A proxy, one prefill and two decode workers on the short model in float32. Sixteen greedy streams of 48 tokens
run once without a switch for the reference. Then, while they run again, the admin API orders the busier decode
worker to become a prefill worker (``POST /admin/workers/{id}/role``): it drains for its ``drain_timeout_s`` (1 s,
so that the streams still on it are handed back and resume on the other decode worker, as after a drain), says
Goodbye, registers under a new epoch as a prefill worker with its model still loaded, and the call answers then.
Every stream completes with its reference text, no KV page is left in use, ``/readyz`` counts 2 prefill workers
and 1 decode worker, and the cluster in its new layout serves the streams again with the same text.
"""
from __future__ import annotations

import asyncio
import hashlib
import json

import httpx
import pytest

from common.cli.local_cluster import LocalCluster
from common.config.roles import ProxyConfig
from tests.e2e.fault_scenarios import (
    Run, busiest, check_nothing_lost, check_pages_freed, completion_bodies, no_fault_run, run_scenario,
    streams_with_text,
)

STREAMS = 16
MAX_TOKENS = 48
DRAIN_S = 1.0  # the decode workers' drain_timeout_s: what still runs on the switching worker then is handed back
ADMIN_KEY = "role-switch-admin-key"
# The admin call answers within the proxy's planner.role_switch_timeout_s (a 504 past it); the client waits longer.
CALL_TIMEOUT_S = ProxyConfig().planner.role_switch_timeout_s + 30


@pytest.fixture(scope="module")
def cluster(short_model_dir, tmp_path_factory):
    c = LocalCluster.for_tests(
        short_model_dir, tmp_path_factory.mktemp("role-switch"), prefill=1, decode=2, dtype="float32",
        proxy_overrides=[f"security.admin_api_key_sha256={hashlib.sha256(ADMIN_KEY.encode()).hexdigest()}"],
        role_overrides=[f"decode:drain_timeout_s={DRAIN_S}"]).start()
    yield c
    c.stop()


def greedy_bodies() -> list[dict]:
    bodies = completion_bodies(STREAMS, MAX_TOKENS)
    for body in bodies:
        for key in ("seed", "frequency_penalty"):
            body.pop(key, None)
        body["temperature"] = 0.0
    return bodies


def switch_busiest_decode_worker(answers: list[tuple[str, httpx.Response]]):
    """An event: the admin API orders the decode worker with the most sequences to serve as a prefill worker."""
    async def event(run: Run) -> None:
        name = await asyncio.to_thread(busiest("decode"), run)
        async with httpx.AsyncClient(timeout=CALL_TIMEOUT_S) as http:
            answers.append((name, await http.post(f"{run.cluster.url}/admin/workers/{name}/role",
                                                  json={"role": "prefill"},
                                                  headers={"Authorization": f"Bearer {ADMIN_KEY}"})))
    return event


def test_a_decode_worker_becomes_a_prefill_worker_while_16_streams_run(cluster):
    bodies = greedy_bodies()
    reference = no_fault_run(cluster, bodies)
    answers: list[tuple[str, httpx.Response]] = []
    results, _ = asyncio.run(run_scenario(cluster, bodies, [streams_with_text(STREAMS),
                                                            switch_busiest_decode_worker(answers)]))
    ((name, answer),) = answers
    assert answer.status_code == 200, answer.text
    switched = answer.json()
    assert (switched["worker_id"], switched["role"], switched["previous_role"]) == (name, "prefill", "decode")
    assert switched["epoch"] > switched["previous_epoch"]
    check_nothing_lost(results, reference, bodies)
    check_pages_freed(cluster)
    status, ready = cluster.get("/readyz")
    assert status == 200 and json.loads(ready)["workers"] == {"prefill": 2, "decode": 1, "both": 0}, ready
    assert cluster.metric("tessera_worker_role_switches_total", cluster.worker_url(name)) == {'{role="prefill"}': 1}
    assert cluster.metric("tessera_proxy_role_switches_total")['{outcome="switched"}'] == 1
    again, _ = asyncio.run(run_scenario(cluster, bodies))
    check_nothing_lost(again, reference, bodies)
    check_pages_freed(cluster)
