"""``tessera bench`` against a real local cluster (proxy + prefill + decode processes, tiny model).

Structure only, no timing claims: every request completes, the result files
follow the schema, the plots are PNG files, and ``compare`` reads them back.
"""
import json

import pytest

from common.cli.local_cluster import LocalCluster
from bench.loadgen.results import check_point
from common.cli.main import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def cluster(tiny_chat_model_dir, tmp_path_factory):
    c = LocalCluster.for_tests(tiny_chat_model_dir, tmp_path_factory.mktemp("bench-logs"), prefill=1, decode=1,
                transfer_backend="zmq").start()
    yield c
    codes = c.stop()
    assert all(code == 0 for code in codes.values()), codes


def test_rate_sweep_with_tenants_writes_results_and_plots(cluster, tiny_chat_model_dir, tmp_path, capsys):
    out = tmp_path / "sweep"
    status = main([
        "bench", "--base-url", cluster.url, "--tokenizer", str(tiny_chat_model_dir),
        "--num-prompts", "8", "--request-rate", "4,16", "--burstiness", "0.5", "--input-len", "16-40",
        "--output-len", "6", "--tenant", "name=gold,key=sk-gold,weight=3", "--tenant", "name=free,key=sk-free",
        "--goodput", "ttft:60000", "tpot:60000", "--percentiles", "50,90,99", "--server-metrics",
        "--max-duration", "120", "--request-timeout", "60", "--result-dir", str(out), "--no-progress",
    ])
    printed = capsys.readouterr().out
    assert status == 0, printed
    assert "rate=4" in printed and "rate=16" in printed and "Jain fairness" in printed

    run = json.loads((out / "result.json").read_text())
    assert run["tessera_bench"] == 1 and run["config"]["model"] == "SmolLM2-135M-Instruct"
    assert all(t["api_key"] is None for t in run["config"]["tenants"])  # keys never reach the files
    assert [p["point"] for p in run["points"]] == ["rate=4", "rate=16"]
    for name in ("point-00-rate-4.json", "point-01-rate-16.json"):
        point = json.loads((out / name).read_text())
        check_point(point)
        assert point["completed"] == 8 and point["failed"] == 0 and point["failures_by_kind"] == {}
        assert point["total_output_tokens"] == 8 * 6  # ignore_eos + max_tokens, counted from usage
        assert point["request_goodput"] == pytest.approx(point["request_throughput"])
        assert point["slo_attainment"] == 1.0 and "p50_ttft_ms" in point and "p90_itl_ms" in point
        assert all(len(point[k]) == 8 for k in ("input_lens", "output_lens", "ttfts", "itls", "latencies"))
        assert all(0 < ttft <= e2e for ttft, e2e in zip(point["ttfts"], point["latencies"]))
        assert set(point["tenants"]) == {"gold", "free"}
        assert sum(t["completed"] for t in point["tenants"].values()) == 8
        assert set(point["tenant_service"]["series"]) == {"gold", "free"}
        server = point["server_metrics"]
        assert server["available"] and server["increase"]["kv_transfer_bytes"] > 0  # prefill handed pages over

    for name in ("latency_cdf.png", "sweep.png", "tenant_service-00.png", "tenant_service-01.png"):
        assert (out / name).read_bytes()[:8] == PNG_MAGIC, name

    assert main(["bench", "compare", str(out / "point-00-rate-4.json"), str(out / "result.json")]) == 0
    assert "request_throughput" in capsys.readouterr().out


def test_chat_endpoint_at_fixed_concurrency_with_the_shipped_prompts(cluster, tmp_path, capsys):
    out = tmp_path / "chat"
    status = main([
        "bench", "--base-url", cluster.url, "--endpoint", "/v1/chat/completions", "--workload", "realistic",
        "--num-prompts", "6", "--max-concurrency", "2", "--output-len", "5", "--max-duration", "120",
        "--request-timeout", "60", "--result-dir", str(out), "--no-plots", "--no-progress",
    ])
    assert status == 0, capsys.readouterr().out
    [point] = json.loads((out / "result.json").read_text())["points"]
    check_point(point)
    assert point["completed"] == 6 and point["max_concurrent_requests"] <= 2
    assert point["backend"] == "openai-chat" and all(n > 0 for n in point["input_lens"])  # from usage
    assert not list(out.glob("*.png"))


def test_multi_turn_conversations_report_each_turn_against_a_cold_prefill(cluster, tiny_chat_model_dir, tmp_path,
                                                                          capsys):
    out = tmp_path / "multiturn"
    status = main([
        "bench", "--base-url", cluster.url, "--tokenizer", str(tiny_chat_model_dir), "--workload", "multi-turn",
        "--turns", "3", "--num-prompts", "3", "--max-concurrency", "2", "--input-len", "24", "--output-len", "6",
        "--request-timeout", "60", "--result-dir", str(out), "--no-progress",
    ])
    printed = capsys.readouterr().out
    assert status == 0, printed
    summary = json.loads((out / "multiturn.json").read_text())
    assert [t["turn"] for t in summary["ttft_ms_by_turn"]] == [1, 2, 3]
    assert all(t["median"] > 0 for t in summary["ttft_ms_by_turn"]) and summary["cold_ttft_ms"]["median"] > 0
    assert summary["last_turn_over_cold"]["median"] > 0 and "last turn / cold" in printed
    sessions = cluster.metric("tessera_proxy_worker_requests_total")
    assert sum(sessions.values()) >= 3 * 4  # three turns and a cold request for each conversation
