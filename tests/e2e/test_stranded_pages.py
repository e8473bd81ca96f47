"""No page stranded, no stale peer: a prefill worker's pages while it drains or restarts, through real processes.

A proxy, one prefill and two decode workers on a tiny model; every decode worker starts each pull
``testing.fault_kv_pull_delay_s`` late, as a congested network would, so the pulls wait while the prefill worker is
signalled. Each test first waits until every stream has its first token: every prompt's pages are then leased on the
prefill worker and none is pulled yet.

1. SIGTERM: the drain serves those pulls, and the ReleaseKV after each, before the worker exits: every stream
   completes with the no-fault text, every pull reads its pages (none recomputed), the worker exits 0 with no lease
   left to expire.
2. kill -9, and the supervisor restarts the worker under the same id before the pulls start: the decode workers know
   it under its new epoch, and refuse the pulls of pages lent under the old one (in the new process those block ids
   hold nothing of those prompts); the prompts are recomputed and the text is still the no-fault one.
"""
from __future__ import annotations

import asyncio
import signal

import pytest

from common.cli.local_cluster import LocalCluster
from tests.e2e.fault_scenarios import (
    Run, check_nothing_lost, check_pages_freed, completion_bodies, exited, no_fault_run, restored, run_scenario,
    send_signal, streams_with_text,
)

STREAMS = 16
MAX_TOKENS = 24
# Long enough that a signalled prefill worker is still lending (1.), or was restarted (2.), before the pulls start.
PULL_DELAY_S = 20.0
LEASE_S = 120.0  # the proxy's kv_lease_s: the drain ends on the pulls, not on the lease
DRAIN_S = 120.0
# Every stream is admitted at once, so that all of them wait for their pulls together: without a TPOT cap on decode
# admission (on while a worker's capacity is still learned, and on loaded cores one worker's came out at 2 slots,
# so 6 of the 16 prompts were admitted only as the first 10 ended, their pulls done).
UNCAPPED = "slo.tpot_slo_scope=never"
DECODERS = ("decode-0", "decode-1")
OUTCOMES = ("ok", "retried_ok", "refused", "recomputed")


@pytest.fixture(scope="module")
def cluster(tiny_chat_model_dir, tmp_path_factory):
    c = LocalCluster.for_tests(
        tiny_chat_model_dir, tmp_path_factory.mktemp("stranded"), prefill=1, decode=2,
        proxy_overrides=[f"kv_lease_s={LEASE_S}", UNCAPPED],
        role_overrides=[f"decode:testing.fault_kv_pull_delay_s={PULL_DELAY_S}", f"prefill:drain_timeout_s={DRAIN_S}"],
    ).start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def bodies_and_reference(cluster):
    bodies = completion_bodies(STREAMS, MAX_TOKENS)
    return bodies, no_fault_run(cluster, bodies)


def pull_outcomes(cluster: LocalCluster) -> dict[str, float]:
    """Every decode worker's pulls, by outcome."""
    counts = dict.fromkeys(OUTCOMES, 0.0)
    for name in DECODERS:
        for labels, value in cluster.metric("tessera_worker_kv_pull_outcomes_total", cluster.worker_url(name)).items():
            counts[labels.split('"')[1]] += value
    return counts


def since(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {outcome: after[outcome] - before[outcome] for outcome in OUTCOMES}


def proxy_pull_failures(cluster: LocalCluster) -> float:
    return sum(cluster.metric("tessera_proxy_kv_transfer_failures_total").values())


def test_sigterm_while_16_requests_wait_for_their_pulls_loses_and_recomputes_nothing(cluster, bodies_and_reference):
    bodies, reference = bodies_and_reference
    before, failed_before = pull_outcomes(cluster), proxy_pull_failures(cluster)
    exits = []

    async def note_exit(run: Run) -> None:  # before the restart writes a new log
        exits.append((run.cluster.procs["prefill-0"].returncode, (cluster.log_dir / "prefill-0.log").read_text()))

    results, run = asyncio.run(run_scenario(cluster, bodies, [
        streams_with_text(STREAMS), send_signal("prefill-0", signal.SIGTERM),
        exited("prefill-0", PULL_DELAY_S + DRAIN_S), note_exit, restored()]))
    check_nothing_lost(results, reference, bodies)
    ((code, log),) = exits
    assert code == 0, log[-3000:]
    assert since(before, pull_outcomes(cluster)) == {"ok": STREAMS, "retried_ok": 0, "refused": 0, "recomputed": 0}
    assert proxy_pull_failures(cluster) == failed_before
    assert f"lending the pages of {STREAMS} requests" in log and "expired unpulled" not in log, log[-3000:]
    check_pages_freed(cluster)


def test_pages_of_a_restarted_prefill_workers_earlier_epoch_are_refused_and_recomputed(cluster, bodies_and_reference):
    bodies, reference = bodies_and_reference
    before, failed_before = pull_outcomes(cluster), proxy_pull_failures(cluster)
    results, run = asyncio.run(run_scenario(cluster, bodies, [
        streams_with_text(STREAMS), send_signal("prefill-0", signal.SIGKILL), exited("prefill-0"), restored()]))
    check_nothing_lost(results, reference, bodies)  # recomputed, never built on the new process's pages
    assert run.supervisor.restarts == {"prefill-0": 1}
    assert since(before, pull_outcomes(cluster)) == {"ok": 0, "retried_ok": 0, "refused": STREAMS, "recomputed": 0}
    assert proxy_pull_failures(cluster) == failed_before + STREAMS
    check_pages_freed(cluster)
