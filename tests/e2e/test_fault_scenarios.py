"""Fault scenarios with real processes: nothing lost, nothing duplicated, nothing leaked (issue 13).

A proxy, 2 prefill and 2 decode workers on the short model (the embedded model's shape in 4 layers:
tests/tiny_models.py), each its own process, driven by the scenario runner (``tests/e2e/fault_scenarios.py``). Sixteen
streams of 48 tokens (half greedy, half seeded with a frequency penalty) run once without a fault for the reference;
each scenario then checks every stream's text against it, its ``usage`` against ``max_tokens``, and that no KV page
stays in use on any worker or in the proxy's view.

1. kill -9 of a prefill worker while it prefills: its prompts resume on the other one.
3. SIGSTOP of a decode worker with streams on it, past ``heartbeat_timeout_s``, then SIGCONT: its
   streams resume on the other one; it re-registers under a new epoch, frees its pages, serves again.
4. A rolling SIGTERM restart of every worker under steady load.
5. KV pulls delayed past the pages' lease (``fault_kv_pull_delay_s`` > ``kv_lease_s``): recomputed,
   never built on pages the prefill worker freed and handed to the next prompts.
6. Clients that leave while their requests wait for their pages: nothing leaks on either side.
7. An idle cluster (heartbeats and the proxy's expiry loop turn many times), then a burst.
(2, kill -9 of a decode worker mid-stream, is tests/e2e/test_failover_processes.py; a decode host's link
cut and restored, tests/e2e/test_fault_link_cut.py.)
"""
from __future__ import annotations

import asyncio
import re
import signal
import time
from pathlib import Path

import pytest

from common.cli.local_cluster import LocalCluster
from tests.e2e.fault_scenarios import (
    Stream, abandon, busiest, check_nothing_lost, check_pages_freed, completion_bodies, exited,
    kill_mid_prefill, last_victim, no_fault_run, restored, run_scenario, send_signal, streams_with_text,
    wait_until, workers_alive,
)

STREAMS = 16
MAX_TOKENS = 48
BODIES = completion_bodies(STREAMS, MAX_TOKENS)
HEARTBEAT_TIMEOUT_S = 2.0
IDLE_S = 45  # >20 heartbeat timeouts, >200 heartbeats per worker


def total(cluster: LocalCluster, name: str, base: str | None = None, worker: str | None = None) -> float:
    """A metric's samples summed (only those labelled ``worker_id=worker``, if given)."""
    found = cluster.metric(name, base)
    return sum(v for labels, v in found.items() if worker is None or f'worker_id="{worker}"' in labels)


@pytest.fixture(scope="module")
def cluster(short_model_dir, tmp_path_factory):
    c = LocalCluster.for_tests(short_model_dir, tmp_path_factory.mktemp("faults"), prefill=2, decode=2,
                               proxy_overrides=[f"heartbeat_timeout_s={HEARTBEAT_TIMEOUT_S}"]).start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def reference(cluster) -> list[Stream]:
    return no_fault_run(cluster, BODIES)


def test_kill_9_of_a_prefill_worker_mid_prefill_loses_nothing(cluster):
    # prompts of about 500 tokens: the short model prefills a seventh of the embedded model's work a token, so the
    # 130-token prompts that kept a prefill worker busy long enough for the kill on the embedded model are too short
    bodies = completion_bodies(STREAMS, 32, prompt=lambda i: f"Chapter {i}. " + (
        "The animal walked slowly through the quiet forest, looking closely at every tree and every stone. " * 24))
    _, run = kill_mid_prefill(cluster, bodies, no_fault_run(cluster, bodies))
    assert run.supervisor.restarts == {run.victims[0]: 1}
    check_pages_freed(cluster)


def test_sigstop_of_a_decode_worker_past_the_heartbeat_timeout(cluster, reference):
    migrations = total(cluster, "tessera_proxy_migrations_total")

    def declared_dead(run) -> bool:
        return total(cluster, "tessera_proxy_heartbeats_missed_total", worker=run.victims[-1]) >= 1

    results, run = asyncio.run(run_scenario(cluster, BODIES, [
        streams_with_text(STREAMS), send_signal(busiest("decode"), signal.SIGSTOP),
        wait_until(declared_dead, "the proxy dropped the stopped worker"),
        send_signal(last_victim, signal.SIGCONT),
        wait_until(lambda run: workers_alive(cluster) == 4, "the woken worker registered again")]))
    victim = run.victims[0]
    check_nothing_lost(results, reference, BODIES)
    assert total(cluster, "tessera_proxy_migrations_total") > migrations, f"nothing resumed off {victim}"
    assert not run.supervisor.restarts, "the stopped worker was restarted, not woken"
    log = (Path(cluster.log_dir) / "proxy.log").read_text()
    epochs = re.findall(rf"registered \w+ worker '{victim}' epoch (\d+)", log)
    assert len(set(epochs)) == 2, f"{victim} registered under epochs {epochs}"
    check_pages_freed(cluster)
    served = total(cluster, "tessera_proxy_worker_requests_total", worker=victim)
    again, _ = asyncio.run(run_scenario(cluster, BODIES))
    check_nothing_lost(again, reference, BODIES)
    assert total(cluster, "tessera_proxy_worker_requests_total", worker=victim) > served, f"{victim} serves no more"


def test_a_rolling_sigterm_restart_of_every_worker_under_steady_load(cluster, reference):
    events = [streams_with_text(4)]
    for name in ("prefill-0", "decode-0", "prefill-1", "decode-1"):
        events += [send_signal(name, signal.SIGTERM), exited(name), restored()]
    results, run = asyncio.run(run_scenario(cluster, BODIES, events, steady=8))
    check_nothing_lost(results, reference, BODIES)
    assert run.supervisor.restarts == {"prefill-0": 1, "decode-0": 1, "prefill-1": 1, "decode-1": 1}
    assert len(results) > STREAMS, "the load did not go on through the restarts"
    check_pages_freed(cluster)


def test_an_idle_cluster_then_a_burst(cluster, reference):
    missed = total(cluster, "tessera_proxy_heartbeats_missed_total")
    time.sleep(IDLE_S)
    assert workers_alive(cluster) == 4
    assert total(cluster, "tessera_proxy_heartbeats_missed_total") == missed, "an idle worker was dropped"
    results, _ = asyncio.run(run_scenario(cluster, BODIES))
    check_nothing_lost(results, reference, BODIES)
    check_pages_freed(cluster)


def delayed_pull_cluster(model_dir: Path, log_dir: Path, lease_s: float, delay_s: float, *prefill: str):
    return LocalCluster.for_tests(model_dir, log_dir, prefill=2, decode=2, proxy_overrides=[f"kv_lease_s={lease_s}"],
                                  role_overrides=[f"decode:testing.fault_kv_pull_delay_s={delay_s}",
                                                  *(f"prefill:{pair}" for pair in prefill)]).start()


def test_a_kv_pull_delayed_past_the_lease_is_recomputed_never_read_from_freed_pages(
        short_model_dir, tmp_path, reference):
    # Four blocks per prefill worker: the prompts after the first four reuse the pages whose lease ran out.
    cluster = delayed_pull_cluster(short_model_dir, tmp_path, 1, 2.5, "engine.num_kv_blocks=4")
    try:
        results, _ = asyncio.run(run_scenario(cluster, BODIES))
        check_nothing_lost(results, reference, BODIES)
        assert total(cluster, "tessera_proxy_kv_transfer_failures_total") == STREAMS, "a pull ran past its lease"
        assert sum(total(cluster, "tessera_worker_kv_lease_expirations_total", cluster.worker_url(name))
                   for name in ("prefill-0", "prefill-1")) > 0
        check_pages_freed(cluster)
    finally:
        cluster.stop()


def test_aborts_while_waiting_for_remote_kv_leak_nothing(short_model_dir, tmp_path, reference):
    cluster = delayed_pull_cluster(short_model_dir, tmp_path, 120, 5)
    try:
        left = list(range(0, STREAMS, 2)) + [1, 3]
        results, _ = asyncio.run(run_scenario(cluster, BODIES, [streams_with_text(STREAMS), abandon(left)]))
        assert sorted(i for i, s in results if s.abandoned) == sorted(left)
        check_nothing_lost(results, reference, BODIES)
        check_pages_freed(cluster)
        decoders = [cluster.worker_url(name) for name in ("decode-0", "decode-1")]
        pulls = sum(total(cluster, m, base) for base in decoders for m in (
            "tessera_worker_kv_transfer_seconds_count", "tessera_worker_kv_transfer_failures_total"))
        assert pulls < STREAMS, "no client left while its request waited for its pages"
        assert not any(total(cluster, "tessera_worker_kv_lease_expirations_total", cluster.worker_url(name))
                       for name in ("prefill-0", "prefill-1")), "an abort left its pages to the lease"
    finally:
        cluster.stop()
