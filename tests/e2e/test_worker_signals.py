"""A worker, and the proxy, drain and exit cleanly however many stop signals reach them at once.

Its signal handler must take no lock: a second signal that interrupts the
first handler while that one holds a lock (a threading.Event's did) hangs
the process for good. Each worker here gets several SIGTERM/SIGTERM or
SIGINT/SIGTERM pairs microseconds to a few milliseconds apart (the race
is a matter of timing, so there are several pairs on several workers), and
must still exit with status 0, say goodbye, and log that it stopped, within
its drain timeout plus the interpreter's own exit. The proxy must not hand
the second signal on to uvicorn, which raised it again after the drain: the
process then died of it (exit -15) instead of exiting with 0.
"""
from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import subprocess
import time

import pytest

from common.cli.local_cluster import LocalCluster
from tests.e2e.fault_scenarios import completion_bodies, exited, run_scenario, send_signal, wait_until

PATTERNS = {"sigterm-sigterm": (signal.SIGTERM, signal.SIGTERM), "sigint-sigterm": (signal.SIGINT, signal.SIGTERM)}
WORKERS_PER_PATTERN = 2
PAIRS_PER_WORKER = 5
DRAIN_S = 5.0
EXIT_MARGIN_S = 15.0  # closing the transfer agent and the interpreter's exit, on a busy 2-core machine


@pytest.fixture(scope="module")
def cluster(tiny_chat_model_dir, tmp_path_factory):
    c = LocalCluster.for_tests(tiny_chat_model_dir, tmp_path_factory.mktemp("signal-logs"), prefill=0, decode=0,
                both=len(PATTERNS) * WORKERS_PER_PATTERN, worker_overrides=[f"drain_timeout_s={DRAIN_S}"]).start()
    yield c
    codes = c.stop()
    assert codes == {"proxy": 0}, codes


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_quick_successive_signals_still_drain_and_exit_cleanly(cluster, pattern):
    first, second = PATTERNS[pattern]
    offset = list(PATTERNS).index(pattern) * WORKERS_PER_PATTERN
    names = [f"both-{offset + i}" for i in range(WORKERS_PER_PATTERN)]
    procs: dict[str, subprocess.Popen] = {name: cluster.procs.pop(name) for name in names}
    rng = random.Random(pattern)
    for name, proc in procs.items():
        assert proc.poll() is None, f"{name} exited before the test: see {cluster.log_dir}/{name}.log"
        for _ in range(PAIRS_PER_WORKER):
            os.kill(proc.pid, first)
            time.sleep(rng.uniform(0, 0.002))
            os.kill(proc.pid, second)
            time.sleep(rng.uniform(0, 0.002))
    deadline = time.monotonic() + DRAIN_S + EXIT_MARGIN_S
    for name, proc in procs.items():
        try:
            code = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            pytest.fail(f"{name} hung after {pattern} (see {cluster.log_dir}/{name}.log)")
        log = (cluster.log_dir / f"{name}.log").read_text()
        assert code == 0, f"{name} exited with {code} after {pattern}:\n{log[-2000:]}"
        assert f"worker {name} stopped" in log and "Traceback" not in log, log[-2000:]
    proxy_log = (cluster.log_dir / "proxy.log").read_text()
    for name in names:
        assert re.search(rf"worker '{name}' \(both, epoch \d+\) removed: it said goodbye \(drained\)", proxy_log), \
            f"the proxy got no Goodbye from {name}:\n{proxy_log[-2000:]}"


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_the_proxy_exits_cleanly_after_two_quick_signals(tiny_chat_model_dir, tmp_path, pattern):
    first, second = PATTERNS[pattern]
    proxy = LocalCluster.for_tests(tiny_chat_model_dir, tmp_path, prefill=0, decode=0)
    proxy.start_proxy()
    deadline = time.monotonic() + 60
    while True:
        try:
            if proxy.get("/healthz")[0] == 200:
                break
        except OSError:
            pass
        assert time.monotonic() < deadline, f"the proxy did not start: see {tmp_path}/proxy.log"
        time.sleep(0.1)
    process = proxy.procs["proxy"]
    os.kill(process.pid, first)
    time.sleep(0.05)  # the drain has started: the second signal cuts it short
    os.kill(process.pid, second)
    try:
        code = process.wait(timeout=30)
    finally:
        proxy.stop()
    assert code == 0, (tmp_path / "proxy.log").read_text()[-2000:]


def test_a_second_signal_cuts_a_drain_short_and_its_streams_resume_elsewhere(short_model_dir, tmp_path):
    """Two aggregated workers; one holding a running stream gets SIGTERM (its drain would let the stream finish, within
    a long drain_timeout_s), then another once the drain started: it gives its streams back at once and exits, and
    each stream completes on the other worker, every token counted once."""
    c = LocalCluster.for_tests(short_model_dir, tmp_path, prefill=0, decode=0, both=2,
                               worker_overrides=["drain_timeout_s=300"]).start()
    bodies = completion_bodies(2, 300)

    def running(name: str) -> bool:
        return sum(c.metric("tessera_worker_running_sequences", c.worker_url(name)).values()) >= 1

    def drain_started(run) -> bool:
        return "draining: no new work" in (c.log_dir / f"{run.victims[-1]}.log").read_text()

    def second_signal(run) -> None:
        return send_signal(run.victims[-1], signal.SIGTERM)(run)

    try:
        results, run = asyncio.run(run_scenario(c, bodies, [
            wait_until(lambda run: running("both-0") and running("both-1"), "a stream on each worker"),
            send_signal("both-0", signal.SIGTERM), wait_until(drain_started, "the drain started"), second_signal,
            exited("both-0")]))
        log = (c.log_dir / "both-0.log").read_text()
        assert "draining: a second signal came" in log and "worker both-0 stopped" in log, log[-2000:]
        assert c.procs["both-0"].returncode == 0
        lost = [(s.status, s.done, s.completion_tokens, s.errors) for _, s in results
                if s.lost or s.completion_tokens != 300]
        assert not lost, lost
        assert sum(c.metric("tessera_proxy_migrations_total").values()) >= 1, "no stream resumed on both-1"
    finally:
        codes = c.stop()
    assert codes.get("proxy") == 0, codes
