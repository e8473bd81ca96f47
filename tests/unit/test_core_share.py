"""Co-located workers time-sharing the cores (common/runtime/core_share.py): one holder at a time, turns
alternate between busy workers, a dead holder frees the cores, and a hung one costs a bounded wait."""
import multiprocessing
import os
import signal
import time

import pytest

from common.runtime.core_share import CoreShare

CTX = multiprocessing.get_context("spawn")  # a fork of the pytest process would share its locks' owner


def _turns(path: str, name: str, count: int, log_path: str, start, done, peer_done) -> None:
    """``count`` turns; each lasts until the peer waits in line (or has finished), so the test asserts the order
    the share guarantees to waiting workers, whatever the machine's load does to the timing."""
    share = CoreShare(path, timeout_s=60, handoff_s=60)
    start.wait()
    for _ in range(count):
        with share:
            with open(log_path, "a") as log:
                log.write(f"{name} in\n")
            deadline = time.monotonic() + 60
            while not share.others_waiting() and not peer_done.is_set():
                assert time.monotonic() < deadline, "the peer never queued for the share"
                time.sleep(0.001)
            with open(log_path, "a") as log:
                log.write(f"{name} out\n")
    done.set()
    share.close()


def _hold_forever(path: str, ready) -> None:
    share = CoreShare(path, timeout_s=30)
    share.__enter__()
    ready.set()
    time.sleep(600)


def test_busy_workers_take_turns_one_at_a_time(tmp_path):
    path, log_path = str(tmp_path / "cores"), str(tmp_path / "log")
    start, done = CTX.Event(), {"a": CTX.Event(), "b": CTX.Event()}
    procs = [CTX.Process(target=_turns, args=(path, name, 8, log_path, start, done[name], done[peer]))
             for name, peer in (("a", "b"), ("b", "a"))]
    for p in procs:
        p.start()
    start.set()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    events = [line.split() for line in open(log_path)]
    assert len(events) == 32
    holder = None
    for name, what in events:  # never two holders: every "in" follows the previous holder's "out"
        if what == "in":
            assert holder is None
            holder = name
        else:
            assert holder == name
            holder = None
    holders = [name for name, what in events if what == "in"]
    # A worker that releases the share while the other waits hands it over: the turns alternate exactly, rather
    # than one worker taking all of its turns first.
    assert all(a != b for a, b in zip(holders, holders[1:])), holders


def test_a_holder_that_dies_frees_the_cores(tmp_path, caplog):
    path = str(tmp_path / "cores")
    ready = CTX.Event()
    holder = CTX.Process(target=_hold_forever, args=(path, ready))
    holder.start()
    assert ready.wait(60)
    os.kill(holder.pid, signal.SIGKILL)
    holder.join(10)
    share = CoreShare(path, timeout_s=60)
    with caplog.at_level("WARNING"), share:
        pass
    assert "no turn on the shared cores" not in caplog.text  # the lock was free, not timed out
    share.close()


def test_a_hung_holder_costs_at_most_the_timeout(tmp_path, caplog):
    path = str(tmp_path / "cores")
    ready = CTX.Event()
    holder = CTX.Process(target=_hold_forever, args=(path, ready))
    holder.start()
    try:
        assert ready.wait(60)
        share = CoreShare(path, timeout_s=0.3)
        with share:  # returns: a hung holder is waited for at most the timeout, then the step runs anyway
            pass
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
