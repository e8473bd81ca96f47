"""The peer harness's pieces that run without vLLM: which model it serves, its roofline, and where it writes."""
from __future__ import annotations

import argparse
import json
import re
import subprocess
from pathlib import Path

import pytest
import torch

from bench import roofline
from bench.peers import compare
from bench.peers.compare import report, results_file, rounds_row, served_model
from bench.processes import VMSTAT_KEYS, compact_memory, host_counters, memory_threads
from bench.roofline import read_bandwidth
from common.config.roles import ProxyConfig, WorkerConfig, load_config, parse_overrides
from common.storage.model_store import EMBEDDED_MODEL
from common.storage.random_model import SHAPES


def test_read_bandwidth_is_a_positive_rate_and_leaves_the_threads_as_they_were():
    threads = torch.get_num_threads()
    assert read_bandwidth(nbytes=1 << 20, passes=2) > 0
    assert torch.get_num_threads() == threads


def test_a_shape_resolves_to_its_cache_directory_and_name_without_writing(tmp_path):
    model = served_model("1b", "bfloat16", cache_dir=tmp_path)
    assert model.path == tmp_path / "models" / "random-1b-bfloat16-s0"
    assert model.name == "random-1b-bfloat16-s0" and model.label == "1b" and model.shape == SHAPES["1b"]
    assert not (tmp_path / "models").exists()


def test_the_embedded_model_and_a_directory_resolve_to_their_names(tmp_path):
    embedded = served_model("embedded", "bfloat16", cache_dir=tmp_path)
    assert (embedded.name, embedded.label, embedded.shape) == (EMBEDDED_MODEL, "", None)
    (tmp_path / "my model").mkdir()
    directory = served_model(str(tmp_path / "my model"), "bfloat16")
    assert (directory.path, directory.name, directory.label) == (tmp_path / "my model", "my model", "my_model")
    with pytest.raises(ValueError, match="give embedded, a shape"):
        served_model(str(tmp_path / "absent"), "bfloat16")


def test_results_files_name_the_model_unless_it_is_the_embedded_one():
    assert re.fullmatch(r"vllm-cpu-(intel|amd|cpu)-(amx|avx512|avx2)\.md", results_file().name)
    assert results_file("1b").name == results_file().name.removesuffix(".md") + "-1b.md"


def test_the_report_gives_one_stream_tpot_over_the_roofline(tmp_path):
    args = argparse.Namespace(model="1b", dtype="bfloat16", input_len=256, output_len=64, num_prompts=8,
                              single_prompts=4, rate=2.0, seed=100)
    # each server's one-stream TPOT against the bandwidth measured just before its point (roofline 10 and 20 ms)
    rows = [{"server": server, "point": "one stream", "load_before": 0.5, "remote_prefill": None,
             "median_tpot_ms": tpot, "read_bandwidth": measured}
            for server, tpot, measured in (("vllm", 20.0, 164.4302336e9), ("tessera-agg", 13.0, 82.2151168e9))]
    model = served_model("1b", "bfloat16", cache_dir=tmp_path)
    text = report(rows, args, model, (822_151_168, 1_644_302_336), bandwidth=164.4302336e9)  # roofline: 10 ms
    assert "Model: random-1b-bfloat16-s0, 822,151,168 parameters, 1.64 GB of weights in bfloat16" in text
    assert "164.4 GB/s" in text and "at least 10.00 ms" in text and "--model 1b " in text
    lines = {line.split(" | ")[0]: line for line in text.splitlines() if line.startswith("| ")}
    assert "one-stream TPOT over the roofline" in lines["| server"]
    assert " | 2.00× (164.4 GB/s) | " in lines["| vllm"] and " | 0.65× (82.2 GB/s) | " in lines["| tessera-agg"]
    assert "the faster probe around each server's one-stream point: 82.2-164.4 GB/s" in text


def test_alternating_rounds_give_medians_of_each_rounds_ratios(tmp_path):
    """--one-stream-rounds: a server's TPOT is the median of its rounds; its ratio to vLLM and over the roofline
    are the medians of each round's, so a round on a slow minute moves both servers alike."""
    weight_bytes = 1_644_302_336

    def run(tpot: float, gbps: float) -> dict:
        return {"median_tpot_ms": tpot, "read_bandwidth": gbps * 1e9, "load_before": 0.1, "remote_prefill": None}

    vllm = [run(40.0, 64.0), run(60.0, 40.0), run(44.0, 60.0)]
    ours = [run(30.0, 64.0), run(48.0, 40.0), run(35.2, 60.0)]
    row = rounds_row("tessera-agg", "one stream", ours, vllm, weight_bytes)
    assert row["median_tpot_ms"] == 35.2 and row["rounds"] == ours
    assert row["ratios"]["median_tpot_ms"] == pytest.approx(0.8)  # 0.75, 0.8, 0.8
    assert row["over_roofline"] == pytest.approx(30.0 / (weight_bytes / 64e9 * 1e3))  # 1.17, 1.17, 1.28
    assert "ratios" not in rounds_row("vllm", "one stream", vllm, vllm, weight_bytes)
    args = argparse.Namespace(model="1b", dtype="bfloat16", input_len=256, output_len=64, num_prompts=8,
                              single_prompts=6, rate=1.0, seed=100, one_stream_rounds=3, servers="vllm,tessera-agg")
    rows = [rounds_row("vllm", "one stream", vllm, vllm, weight_bytes), row]
    text = report(rows, args, served_model("1b", "bfloat16", cache_dir=tmp_path), (822_151_168, weight_bytes),
                  bandwidth=64e9)
    assert "--servers vllm,tessera-agg " in text and "--one-stream-rounds 3 --write" in text
    assert "in 3 rounds of every server in turn" in text and "(seeds 102..104)" in text
    tessera = next(line for line in text.splitlines() if line.startswith("| tessera-agg |"))
    assert "35.2 (0.80×, median of 3 rounds)" in tessera


def test_every_point_in_rounds_takes_seeds_of_its_own_and_medians_of_each_rounds_ratios(monkeypatch, tmp_path):
    """--rounds: each point's rounds draw the seeds after the rounds before them; the servers take turns in an order
    that rotates; a saturation row's throughput ratio is the median of each round's, not the ratio of medians."""
    args = argparse.Namespace(seed=100, rounds=3, one_stream_rounds=0, num_prompts=8, single_prompts=5, rate=1.0)
    assert [compare.round_seed(args, index, r) for index in range(3) for r in range(3)] == list(range(100, 109))
    args.one_stream_rounds = 2
    assert compare.round_seed(args, 2, 1) == 107 and compare.point_rounds(args, 2) == 2
    args.one_stream_rounds = 0
    throughput = {("vllm", 100): 50.0, ("ours", 100): 55.0, ("vllm", 101): 100.0, ("ours", 101): 90.0,
                  ("vllm", 102): 60.0, ("ours", 102): 63.0}
    calls = []

    def measured(server, point, *rest):
        calls.append((server.name, point.seed, point.num_prompts))
        return {"server": server.name, "point": point.name, "load_before": 0.0, "remote_prefill": None,
                "output_throughput": throughput.get((server.name, point.seed), 1.0), "median_tpot_ms": 10.0,
                "read_bandwidth": 50e9 if point.concurrency == 1 else None}
    monkeypatch.setattr(compare, "measured_point", measured)
    servers = [argparse.Namespace(name="vllm"), argparse.Namespace(name="ours")]
    rows = compare.in_rounds(servers, args, None, tmp_path, 1_000_000_000, range(3))
    assert calls[:6] == [("vllm", 100, 8), ("ours", 100, 8), ("ours", 101, 8), ("vllm", 101, 8),
                         ("vllm", 102, 8), ("ours", 102, 8)]
    assert {prompts for name, seed, prompts in calls if seed >= 106} == {2}  # 5 one-stream prompts over 3 rounds
    ours = next(row for row in rows if row["server"] == "ours" and row["point"] == "saturation")
    assert ours["output_throughput"] == 63.0 and ours["ratios"]["output_throughput"] == pytest.approx(1.05)
    assert [row["point"] for row in rows] == ["saturation"] * 2 + ["1 req/s"] * 2 + ["one stream"] * 2


def test_a_one_stream_point_is_set_against_the_faster_probe_around_it(monkeypatch, tmp_path):
    probes = iter([40e9, 55e9])
    monkeypatch.setattr(compare, "read_bandwidth", lambda: next(probes))
    monkeypatch.setattr(compare, "run_point", lambda *a: {"median_tpot_ms": 30.0})
    point = compare.Point("one stream", 5, 4, concurrency=1)
    row = compare.measured_point(None, point, None, None, tmp_path)
    assert row["read_bandwidth_probes"] == (40e9, 55e9) and row["read_bandwidth"] == 55e9
    saturation = compare.measured_point(None, compare.Point("saturation", 6, 4), None, None, tmp_path)
    assert saturation["read_bandwidth"] is None


def test_a_point_that_completed_fewer_requests_than_it_sent_is_an_error(monkeypatch, tmp_path):
    class Stub:
        name, url = "vllm", "http://127.0.0.1:1"

        def dispatches(self):
            return None

        def cpu_seconds(self):
            return {}

    def bench_serve(command, **kwargs):  # what `vllm bench serve` leaves when the server died mid-point
        (tmp_path / command[command.index("--result-filename") + 1]).write_text('{"completed": 0}')
        return subprocess.CompletedProcess(command, 0, "", "")
    monkeypatch.setattr(compare.subprocess, "run", bench_serve)
    args = argparse.Namespace(vllm_venv=tmp_path, input_len=8, output_len=4)
    model = compare.ServedModel("m", tmp_path, "")
    with pytest.raises(RuntimeError, match="vllm completed 0 of the 6 requests of its one stream point"):
        compare.run_point(Stub(), compare.Point("one stream", 5, 6, concurrency=1), args, model, tmp_path)


def point_of(server, monkeypatch, tmp_path) -> tuple[dict, argparse.Namespace]:
    """A saturation point of 4 requests run against ``server`` by a stand-in for ``vllm bench serve`` that reports
    20 s; its row, and the arguments it ran under."""
    def bench_serve(command, **kwargs):
        (tmp_path / command[command.index("--result-filename") + 1]).write_text(
            json.dumps({"completed": 4, "duration": 20.0, "output_throughput": 10.0}))
        return subprocess.CompletedProcess(command, 0, "", "")
    monkeypatch.setattr(compare.subprocess, "run", bench_serve)
    args = argparse.Namespace(vllm_venv=tmp_path, input_len=8, output_len=5, num_prompts=4, single_prompts=2, seed=1,
                              rate=1.0, rounds=2, one_stream_rounds=0)
    return compare.run_point(server, compare.Point("saturation", 5, 4), args, compare.ServedModel("m", tmp_path, ""),
                             tmp_path), args


def test_a_point_records_each_processs_cpu_and_the_report_gives_it_per_output_token(monkeypatch, tmp_path):
    """Each server process's CPU-seconds over the point (a process that appeared meanwhile counts from zero), summed
    over the rounds, per output token in the report's table, with the cores' busy share over the duration."""
    class Stub:
        name, url = "tessera-pd", "http://127.0.0.1:1"
        readings = [{"proxy": 10.0, "decode-0": 100.0}, {"proxy": 12.0, "decode-0": 130.0, "prefill-0": 8.0}]

        def dispatches(self):
            return None

        def cpu_seconds(self):  # the first reading, then the last one whenever sampled
            return self.readings.pop(0) if len(self.readings) > 1 else self.readings[0]

    run, args = point_of(Stub(), monkeypatch, tmp_path)
    assert {key: run["cpu_s"][key] for key in ("proxy", "decode-0", "prefill-0")} == \
        {"proxy": 2.0, "decode-0": 30.0, "prefill-0": 8.0}
    assert run["cpu_s"]["client"] >= 0 and run["duration"] == 20.0
    run["cpu_s"]["client"] = 0.0
    row = rounds_row("tessera-pd", "saturation", [run, run], None, 1)
    assert row["cpu_s"]["decode-0"] == 60.0 and row["duration"] == 40.0 and row["completed"] == 8
    monkeypatch.setattr(compare.os, "cpu_count", lambda: 2)
    table = compare.cpu_table([row], args)  # 40 output tokens: decode 60 s -> 1,500 ms each
    # the servers' 80 CPU-s over 40 s on 2 cores (the client's, here none, is not the server's)
    assert "| tessera-pd | decode-0 1500.00, prefill-0 400.00, proxy 100.00 | 2000.00 | 100% |" in table
    # a process of a later round only is counted, an exited one's reading gives 0, never less
    later = dict(run, cpu_s={"proxy": 1.0, "decode-0": 2.0, "client": 0.0, "prefill-1": 3.0})
    assert rounds_row("tessera-pd", "saturation", [run, later], None, 1)["cpu_s"]["prefill-1"] == 3.0


def test_a_point_records_what_the_hosts_kernel_did_and_the_report_tabulates_it(monkeypatch, tmp_path):
    """The host's reclaim, compaction, system time and steal over the point, summed over rounds, in their own table
    (another server's memory up beside shows there, not in the measured server's CPU)."""
    class Stub:
        name, url = "tessera-pd", "http://127.0.0.1:1"

        def dispatches(self):
            return None

        def cpu_seconds(self):
            return {"decode-0": 1.0}
    readings = [{"system_s": 100.0, "idle_s": 50.0, "steal_s": 1.0, "memory_threads_s": 3.0, "pgscan_kswapd": 10.0,
                 "compact_stall": 2.0, "compact_fail": 1.0, "thp_fault_fallback": 0.0},
                {"system_s": 104.0, "idle_s": 52.0, "steal_s": 1.4, "memory_threads_s": 4.5,
                 "pgscan_kswapd": 5010.0, "compact_stall": 9.0, "compact_fail": 6.0, "thp_fault_fallback": 3.0}]
    monkeypatch.setattr(compare, "host_counters", lambda threads: readings.pop(0) if len(readings) > 1 else readings[0])

    run, _ = point_of(Stub(), monkeypatch, tmp_path)
    assert run["host"] == {"system_s": 4.0, "idle_s": 2.0, "steal_s": 0.4, "memory_threads_s": 1.5,
                           "pgscan_kswapd": 5000.0, "compact_stall": 7.0, "compact_fail": 5.0,
                           "thp_fault_fallback": 3.0}
    row = rounds_row("tessera-pd", "saturation", [run, run], None, 1)
    assert row["host"]["pgscan_kswapd"] == 10000.0 and row["duration"] == 40.0
    monkeypatch.setattr(compare.os, "cpu_count", lambda: 2)
    # 8 s of system time over 40 s on 2 cores: 10%; steal 0.8 s: 1%
    assert "| tessera-pd | saturation | 3.00 | 10.0% | 1.0% | 10,000 | 14 (10) | 6 |" in compare.host_table([row])


def test_the_hosts_counters_read_this_kernel():
    threads = memory_threads()
    names = ("kswapd", "kcompactd", "khugepaged")
    assert all(Path(f"/proc/{pid}/comm").read_text().startswith(names) for pid in threads)  # kernel threads stay
    kswapd = [pid for pid in threads if Path(f"/proc/{pid}/comm").read_text().startswith("kswapd")]
    assert bool(kswapd) == any(Path(f"/proc/{pid}/comm").read_text().startswith("kswapd")
                               for pid in range(1, 200) if Path(f"/proc/{pid}/comm").exists())  # started at boot
    counters = host_counters(threads)
    vmstat = {key: float(value) for key, value in
              (line.split() for line in Path("/proc/vmstat").read_text().splitlines())}
    after = host_counters(threads)
    assert 0 < counters["system_s"] <= after["system_s"] and 0 < counters["idle_s"] <= after["idle_s"]
    # each counter the kernel has, read as it counts (never more than a moment later), and none it lacks
    assert {key for key in VMSTAT_KEYS if key in counters} == {key for key in VMSTAT_KEYS if key in vmstat}
    assert all(counters[key] <= vmstat[key] <= after[key] for key in VMSTAT_KEYS if key in vmstat)
    assert ("memory_threads_s" in counters) == bool(threads)


def test_compacting_memory_the_reports_word_on_it_and_a_workers_huge_page_line(tmp_path):
    """compact_memory writes the kernel's control file when it can (root), and says so; elsewhere it says it could
    not, and the report then claims nothing. A worker's load line gives its weights' share of 2 MB pages."""
    control = tmp_path / "compact_memory"
    assert compact_memory(control) and control.read_text() == "1"
    assert not compact_memory(tmp_path / "absent" / "compact_memory")
    args = argparse.Namespace(model="1b", dtype="bfloat16", input_len=256, output_len=64, num_prompts=8,
                              single_prompts=4, rate=2.0, seed=100)
    model = served_model("1b", "bfloat16", cache_dir=tmp_path)
    said = "The host's memory was compacted before each server started"
    assert said not in report([], args, model, (822_151_168, 1_644_302_336), bandwidth=64e9)
    args.compacted = True
    assert said in report([], args, model, (822_151_168, 1_644_302_336), bandwidth=64e9)
    line = ("linear weights in the panel layout (kernels/panels_bf16.h), which the decode kernel and "
            "kernels/linear_panels.c read: their only copy; 1530 of their 1568 MiB in 2 MB pages (transparent "
            "huge pages: madvise)")
    assert compare.HUGE_PAGES_SAID.search(line).group(0) == "1530 of their 1568 MiB in 2 MB pages"
    in_small = line.replace("1530 of their 1568 MiB in 2 MB", "in 4 KB")
    assert compare.HUGE_PAGES_SAID.search(in_small).group(0) == "in 4 KB pages"


def test_the_host_table_says_n_a_for_a_counter_this_host_lacks(monkeypatch):
    monkeypatch.setattr(compare.os, "cpu_count", lambda: 2)
    row = {"server": "vllm", "point": "one stream", "duration": 10.0,
           "host": {"system_s": 1.0, "idle_s": 5.0, "steal_s": 0.0, "pgscan_kswapd": 12.0}}
    assert "| vllm | one stream | n/a | 5.0% | 0.0% | 12 | n/a (n/a) | n/a |" in compare.host_table([row])


def test_the_read_probe_shrinks_to_a_quarter_of_the_memory_available_but_not_into_the_cache(monkeypatch):
    # at least eight times the last-level cache, at most a quarter of the memory available, never under twice the cache
    monkeypatch.setattr(roofline, "_l3_bytes", lambda: 32 << 20)
    monkeypatch.setattr(roofline, "meminfo_bytes", lambda field: 20 << 30)
    assert roofline.read_probe_bytes() == roofline.READ_BYTES
    monkeypatch.setattr(roofline, "meminfo_bytes", lambda field: 2 << 30)
    assert roofline.read_probe_bytes() == 512 << 20
    monkeypatch.setattr(roofline, "meminfo_bytes", lambda field: 1600 << 20)
    assert roofline.read_probe_bytes() == 400 << 20
    monkeypatch.setattr(roofline, "meminfo_bytes", lambda field: 100 << 20)
    assert roofline.read_probe_bytes() == 64 << 20  # twice the last-level cache, past the quarter
    # a virtual machine reporting its host's whole cache: eight times it would be past the quarter
    monkeypatch.setattr(roofline, "_l3_bytes", lambda: 480 << 20)
    monkeypatch.setattr(roofline, "meminfo_bytes", lambda field: 8 << 30)
    assert roofline.read_probe_bytes() == 2 << 30
    monkeypatch.setattr(roofline, "meminfo_bytes", lambda field: 60 << 30)
    assert roofline.read_probe_bytes() == 8 * (480 << 20)


def test_servers_held_at_once_must_leave_a_tenth_of_the_memory(monkeypatch):
    meminfo = {"MemTotal": 24 << 30, "MemAvailable": 3 << 30}
    monkeypatch.setattr(compare, "meminfo_bytes", meminfo.get)
    compare.check_memory_left(["vllm", "tessera-pd"])  # 12.5% left: measured
    meminfo["MemAvailable"] = 1 << 30
    with pytest.raises(SystemExit, match=r"vllm, tessera-pd held at once leave 1\.0 GiB of 24\.0 GiB available"):
        compare.check_memory_left(["vllm", "tessera-pd"])
    monkeypatch.setattr(compare, "meminfo_bytes", lambda field: None)  # no /proc/meminfo: nothing to go by
    compare.check_memory_left(["vllm"])


def test_a_server_that_would_not_fit_beside_those_up_is_refused_before_it_starts(monkeypatch):
    """In rounds, a second server of a family already up needs about what that one holds."""
    class Up:
        def __init__(self, name, held):
            self.name, self.held = name, held

        def resident_bytes(self):
            return self.held
    meminfo = {"MemTotal": 24 << 30, "MemAvailable": 11 << 30}
    monkeypatch.setattr(compare, "meminfo_bytes", meminfo.get)
    up = [Up("vllm", 8 << 30), Up("tessera-pd", 12 << 30)]
    compare.check_room_for("tessera-agg", up)  # no agg up to go by: the check after its start applies
    compare.check_room_for("vllm-no-iomp", up)  # 11 - 8 = 3 GiB left, over 10% of 24
    with pytest.raises(SystemExit, match=r"tessera-pd-local would need about 12\.0 GiB, as the tessera-pd server up "
                                         r"holds, of the 11\.0 GiB available"):
        compare.check_room_for("tessera-pd-local", up)
    assert compare.server_family("tessera-pd-split") == "tessera-pd"
    assert compare.server_family("tessera-agg-int8") == "tessera-agg"


def test_a_servers_resident_memory_is_read_from_its_processes():
    server = compare.Server.__new__(compare.Server)
    server._cluster, server._proc = None, subprocess.Popen(["sleep", "30"])
    try:
        assert 0 < server.resident_bytes() < 1 << 30
    finally:
        server._proc.kill()
        server._proc.wait()


def test_a_runs_own_worker_settings_are_checked_at_once_and_named_in_the_reports_command(tmp_path, capsys):
    with pytest.raises(SystemExit):
        compare.main(["--vllm-venv", str(tmp_path), "--set", "engine.no_such_setting=1"])
    assert "--set: " in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a role's prefix would reach some servers' workers only, or none
        compare.main(["--vllm-venv", str(tmp_path), "--set", "prefill:engine.kv_cache_memory_bytes=1073741824"])
    assert "without a ROLE: prefix" in capsys.readouterr().err
    args = argparse.Namespace(model="1b", dtype="bfloat16", input_len=8, output_len=5, num_prompts=4, single_prompts=2,
                              seed=1, rate=1.0, rounds=0, one_stream_rounds=0, servers="tessera-pd",
                              set=["engine.kv_cache_memory_bytes=1073741824"])
    text = report([], args, served_model("1b", "bfloat16", cache_dir=tmp_path), (822_151_168, 1_644_302_336),
                  bandwidth=164.4302336e9)
    assert "--servers tessera-pd --set engine.kv_cache_memory_bytes=1073741824 --dtype bfloat16" in text


def test_every_tessera_server_name_asks_for_settings_its_roles_accept():
    for name in compare.SERVERS:
        if name == "vllm":
            continue
        worker, proxy = compare.variant_settings(name)
        load_config(WorkerConfig, overrides=parse_overrides(worker, "decode"))
        load_config(ProxyConfig, overrides=parse_overrides(proxy, "proxy"))
    assert compare.variant_settings("tessera-pd") == ([], [])
    assert compare.variant_settings("tessera-pd-local") == ([], ["local_prefill_threshold=1048576"])
    assert compare.variant_settings("tessera-agg-no-compact") == (["engine.cpu.compact_panels=off"], [])
    assert compare.variant_settings("tessera-agg-int8-kv-int8") == (
        ["engine.quantization=int8", "engine.cpu.kv_cache_dtype=int8"], [])


def test_the_rate_point_can_sit_at_a_share_of_vllms_measured_saturation(monkeypatch, tmp_path):
    """--rate-of-vllm: the rate rounds arrive at that share of the requests a second vLLM's saturation rounds served
    (their median), and the report gives the flag, not the rate it came to."""
    args = argparse.Namespace(seed=100, rounds=2, one_stream_rounds=0, num_prompts=8, single_prompts=4, rate=1.0,
                              rate_of_vllm=0.8, output_len=64, input_len=256, model="1b", dtype="bfloat16",
                              servers="vllm,ours")
    served = {100: 48.0, 101: 52.0}  # vLLM's saturation rounds: a median of 50 tok/s, 0.78 req/s of 64 tokens
    rates = []

    def measured(server, point, *rest):
        if point.name.startswith("saturation"):
            throughput = served[point.seed] if server.name == "vllm" else 55.0
        else:
            rates.extend([point.rate] if point.concurrency is None else [])
            throughput = 40.0
        return {"server": server.name, "point": point.name, "load_before": 0.0, "remote_prefill": None,
                "output_throughput": throughput, "median_tpot_ms": 10.0, "median_ttft_ms": 100.0,
                "read_bandwidth": 50e9 if point.concurrency == 1 else None}
    monkeypatch.setattr(compare, "measured_point", measured)
    servers = [argparse.Namespace(name="vllm"), argparse.Namespace(name="ours")]
    rows = compare.in_rounds(servers, args, None, tmp_path, 1_000_000_000, range(3))
    assert args.rate == 0.625 and set(rates) == {"0.625"}
    assert {row["point"] for row in rows} == {"saturation", "0.625 req/s", "one stream"}
    text = report(rows, args, served_model("1b", "bfloat16", cache_dir=tmp_path), (822_151_168, 1_644_302_336),
                  bandwidth=64e9)
    assert "--rate-of-vllm 0.8 --seed 100 --rounds 2 --write" in text and "TPOT p50 ms at 0.625 req/s" in text
    assert "The rate point's 0.625 req/s is 0.8 of the requests vLLM served a second at saturation" in text
    with pytest.raises(SystemExit):
        compare.main(["--rate-of-vllm", "0.8", "--servers", "vllm,tessera-pd"])  # without --rounds
    with pytest.raises(SystemExit):
        compare.main(["--rate-of-vllm", "-1", "--rounds", "2"])
    args.servers, rows = "ours", [row for row in rows if row["server"] != "vllm"]
    with pytest.raises(RuntimeError, match="no saturation throughput of vllm"):
        compare.rate_of_vllm(rows, args)
