"""Co-located workers time-sharing the cores (common/runtime/core_share.py): one holder at a time, turns
alternate between busy workers, a dead holder frees the cores, and a hung one costs a bounded wait."""
import multiprocessing
import os
import signal
import time

import pytest

from common.runtime.core_share import CoreShare

CTX = multiprocessing.get_context("spawn")  # a fork of the pytest process would share its locks' owner


def _turns(path: str, name: str, count: int, hold_s: float, log_path: str, start) -> None:
    share = CoreShare(path, timeout_s=30)
    start.wait()
    for _ in range(count):
        with share:
            with open(log_path, "a") as log:
                log.write(f"{name} in {time.monotonic()}\n")
            time.sleep(hold_s)
            with open(log_path, "a") as log:
                log.write(f"{name} out {time.monotonic()}\n")
    share.close()


def _hold_forever(path: str, ready) -> None:
    share = CoreShare(path, timeout_s=30)
    share.__enter__()
    ready.set()
    time.sleep(600)


def test_busy_workers_take_turns_one_at_a_time(tmp_path):
    path, log_path = str(tmp_path / "cores"), str(tmp_path / "log")
    start = CTX.Event()
    procs = [CTX.Process(target=_turns, args=(path, name, 8, 0.02, log_path, start)) for name in ("a", "b")]
    for p in procs:
        p.start()
    time.sleep(1.0)  # both imported and waiting at the start line
    start.set()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    events = [line.split() for line in open(log_path)]
    assert len(events) == 32
    holder = None
    for name, what, _ in events:  # never two holders: every "in" follows the previous holder's "out"
        if what == "in":
            assert holder is None
            holder = name
        else:
            assert holder == name
            holder = None
    holders = [name for name, what, _ in events if what == "in"]
    # Both busy the whole time: the share changes hands on (nearly) every turn rather than one worker
    # taking all of its turns first.
    switches = sum(a != b for a, b in zip(holders, holders[1:]))
    assert switches >= 10, holders


def test_a_holder_that_dies_frees_the_cores(tmp_path):
    path = str(tmp_path / "cores")
    ready = CTX.Event()
    holder = CTX.Process(target=_hold_forever, args=(path, ready))
    holder.start()
    assert ready.wait(60)
    os.kill(holder.pid, signal.SIGKILL)
    holder.join(10)
    share = CoreShare(path, timeout_s=5)
    started = time.monotonic()
    with share:
        pass
    assert time.monotonic() - started < 1.0
    share.close()


def test_a_hung_holder_costs_at_most_the_timeout(tmp_path, caplog):
    path = str(tmp_path / "cores")
    ready = CTX.Event()
    holder = CTX.Process(target=_hold_forever, args=(path, ready))
    holder.start()
    try:
        assert ready.wait(60)
        share = CoreShare(path, timeout_s=0.3)
        started = time.monotonic()
        with share:
            waited = time.monotonic() - started
        assert 0.25 <= waited < 5
        assert "core_share_timeout_s=0.3" in caplog.text
        share.close()
    finally:
        holder.kill()
        holder.join(10)


@pytest.mark.parametrize("shared", [False, True])
def test_local_cluster_names_one_share_file_only_when_asked(shared):
    from common.cli.local_cluster import LocalCluster

    cluster = LocalCluster(threads=0, share_cores=shared)
    spawned = {}
    cluster._spawn = lambda name, args: spawned.setdefault(name, args)
    cluster.start_worker("prefill", 0)
    cluster.start_worker("decode", 0)
    for args in spawned.values():
        assert (f"core_share={cluster.core_share_file}" in args) is shared
        threads = int(next(a for a in args if a.startswith("engine.num_threads=")).partition("=")[2])
        assert threads == ((os.cpu_count() or 1) if shared else max(1, (os.cpu_count() or 1) // 2))
