"""A prefill worker stopped with SIGTERM while its prompts' pages wait to be pulled: nothing lost, nothing recomputed.

A proxy, one prefill and two decode workers, real processes; every decode worker starts each pull
``testing.fault_kv_pull_delay_s`` late, as a congested network would. Once all sixteen streams have their first token
(so every prompt's pages are leased on the prefill worker and none is pulled yet) the prefill worker gets SIGTERM. Its
drain must serve those pulls, and the ReleaseKV after each, before it exits: every stream completes with the
no-fault text, no pull fails, no prompt is recomputed, and the worker exits 0 with no lease left to expire.
"""
from __future__ import annotations

import asyncio
import signal

import pytest

from common.cli.local_cluster import LocalCluster
from tests.e2e.fault_scenarios import (
    check_nothing_lost, check_pages_freed, completion_bodies, exited, no_fault_run, run_scenario, send_signal,
    streams_with_text,
)

STREAMS = 16
MAX_TOKENS = 24
PULL_DELAY_S = 4.0  # long enough that SIGTERM lands while every pull waits
LEASE_S = 120.0  # the proxy's kv_lease_s: the drain must end on the pulls, not on the lease
DRAIN_S = 120.0
DECODERS = ("decode-0", "decode-1")


def total(cluster: LocalCluster, name: str, base: str | None = None) -> float:
    return sum(cluster.metric(name, base).values())


@pytest.fixture(scope="module")
def cluster(tiny_chat_model_dir, tmp_path_factory):
    c = LocalCluster.for_tests(
        tiny_chat_model_dir, tmp_path_factory.mktemp("prefill-drain"), prefill=1, decode=2,
        proxy_overrides=[f"kv_lease_s={LEASE_S}"],
        role_overrides=[f"decode:testing.fault_kv_pull_delay_s={PULL_DELAY_S}", f"prefill:drain_timeout_s={DRAIN_S}"],
    ).start()
    yield c
    c.stop()


def test_sigterm_while_16_requests_wait_for_their_pulls_loses_and_recomputes_nothing(cluster):
    bodies = completion_bodies(STREAMS, MAX_TOKENS)
    reference = no_fault_run(cluster, bodies)
    failed_before = total(cluster, "tessera_proxy_kv_transfer_failures_total")
    recomputed_before = sum(total(cluster, "tessera_worker_kv_transfer_failures_total", cluster.worker_url(name))
                            for name in DECODERS)
    results, run = asyncio.run(run_scenario(cluster, bodies, [
        streams_with_text(STREAMS), send_signal("prefill-0", signal.SIGTERM), exited("prefill-0", DRAIN_S + 30)]))
    check_nothing_lost(results, reference, bodies)
    assert cluster.procs["prefill-0"].returncode == 0
    assert total(cluster, "tessera_proxy_kv_transfer_failures_total") == failed_before, "a pull failed"
    recomputed = sum(total(cluster, "tessera_worker_kv_transfer_failures_total", cluster.worker_url(name))
                     for name in DECODERS)
    assert recomputed == recomputed_before, "a prompt was recomputed on a decode worker"
    log = (cluster.log_dir / "prefill-0.log").read_text()
    assert "expired unpulled" not in log, log[-3000:]
    check_pages_freed(cluster)
