"""The pipelined hand-off benchmark end to end on the tiny model: structure only, no timing claims."""
from bench.kv_pipeline import render_markdown, run_benchmark


def test_benchmark_compares_both_modes_on_one_length(tiny_chat_model_dir, tmp_path):
    result = run_benchmark(tiny_chat_model_dir, tmp_path, lengths=[64], requests=1, layer_groups=2,
                           cluster_options={"transfer_backend": "zmq",
                                            # 4 KB pages: the same bytes, a quicker start (TEST_WORKER_OVERRIDES)
                                            "worker_overrides": ["engine.cpu.huge_pages=false"],
                                            "proxy_overrides": ["served_model_name=SmolLM2-135M-Instruct"]})
    assert all(code == 0 for codes in result["exit_codes"].values() for code in codes.values()), result["exit_codes"]
    [row] = result["rows"]
    for mode in ("after first token", "pipelined"):
        [sample] = row[mode]["samples"]
        assert 0 < sample["ttft_s"] <= sample["second_token_s"] <= sample["e2e_s"]
        assert row[mode]["transfer_part_mean_s"] > 0  # one split hand-off in each
    assert row["outputs_match"]
    assert "| 64 |" in render_markdown(result)
