"""bench/soak.py's accounting of a soak with proxy kills: a proxy process's kill is reported from its clients' side
(the streams whose connection broke after it, and when each got its next event), a worker's from the proxy's
recovery lines; the reconnects' summary tells the clients' own drops from the faults'."""
from __future__ import annotations

import argparse

from bench.fault_harness import Stream
from bench.soak import Soak, reconnects
from common.cli.local_cluster import LocalCluster


def stream(index: int, *breaks: tuple[float, float | None, bool]) -> Stream:
    s = Stream(index, 8, ended_at=100.0)
    s.done, s.usage_tokens, s.token_times = True, 8, [0.0] * 8
    s.reconnects = [{"at": at, "resumed_at": resumed, "by_client": by_client, "tries": 1}
                    for at, resumed, by_client in breaks]
    return s


def test_a_proxy_kill_counts_the_streams_it_broke_and_a_worker_kill_the_proxys_recovery_lines():
    soak = Soak(LocalCluster(proxy_processes=2), argparse.Namespace(seed=0), rate=1.0)
    soak.kills = [{"victim": "proxy-0", "pid": 1, "killed_at": 10.0, "at_s": 10.0, "whole_again_at": 12.0},
                  {"victim": "decode-1", "pid": 2, "killed_at": 20.0, "at_s": 20.0, "whole_again_at": None}]
    soak.streams = [stream(0, (10.1, 10.6, False)), stream(1, (10.2, None, False)), stream(2, (10.3, 10.4, True)),
                    stream(3, (20.5, 21.0, False))]  # a break after the worker's kill: not the proxy's
    lines = [{"lost": "decode-1", "detected_at": 20.2, "recovered_at": 20.9},
             {"lost": "decode-0", "detected_at": 20.3, "recovered_at": 20.8}]
    proxy, worker = soak.kill_report(lines)
    assert (proxy["resumed"], proxy["recovered"]) == (2, 1)
    assert round(proxy["detection_s"], 3) == 0.1 and round(proxy["all_recovered_s"], 3) == 0.6
    assert proxy["whole_again_s"] == 2.0
    assert (worker["resumed"], worker["recovered"], worker["whole_again_s"]) == (1, 1, None)
    assert round(worker["all_recovered_s"], 3) == 0.9
    summary = reconnects(soak.streams)
    assert (summary["by_fault"], summary["by_client"], summary["resumed"]) == (3, 1, 3)
