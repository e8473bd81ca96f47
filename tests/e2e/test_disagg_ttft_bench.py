"""The disaggregated-TTFT benchmark end to end on the tiny model: structure only, no timing claims."""
from bench.disagg_ttft import MAX_TOKENS, render_markdown, render_text, run_benchmark


def test_benchmark_compares_both_modes_on_one_length(tiny_chat_model_dir, tmp_path):
    result = run_benchmark(tiny_chat_model_dir, tmp_path, lengths=[32], requests=1, backend="zmq")

    assert all(code == 0 for codes in result["exit_codes"].values() for code in codes.values()), result["exit_codes"]
    [row] = result["rows"]
    assert row["length"] == 32
    disagg, local = row["disaggregated"], row["local"]
    for mode in (disagg, local):
        [sample] = mode["samples"]
        assert 0 < sample["ttft_s"] <= sample["second_token_s"] <= sample["e2e_s"]
        assert mode["kv_pull_failures"] == 0
    # Only the disaggregated cluster moves pages: one pull of the 32-token prompt's blocks.
    assert disagg["kv_pulls"] == 1 and disagg["kv_bytes_per_request"] > 0 and disagg["kv_pull_mean_s"] > 0
    assert local["kv_pulls"] == 0 and local["kv_bytes_per_request"] == 0
    assert row["ttft_ratio_median"] > 0 and row["outputs_match"]
    assert result["max_tokens"] == MAX_TOKENS
    assert "32" in render_text(result)
    assert "| 32 |" in render_markdown(result, "python -m bench.disagg_ttft --lengths 32")
