"""The aggregated-vs-disaggregated driver end to end on the tiny model: both layouts run, the table is written."""
import json

from bench.loadgen.agg_vs_disagg import main


def test_both_layouts_run_and_the_table_names_them(tiny_chat_model_dir, tmp_path, capsys):
    status = main(["--result-dir", str(tmp_path), "--model", str(tiny_chat_model_dir), "--",
                   "--tokenizer", str(tiny_chat_model_dir), "--request-rate", "8", "--num-prompts", "3",
                   "--input-len", "16", "--output-len", "4", "--max-duration", "120", "--no-progress"])
    assert status == 0
    table = (tmp_path / "table.md").read_text()
    assert "| 8 | aggregated |" in table and "| 8 | disaggregated |" in table
    for layout in ("aggregated", "disaggregated"):
        run = json.loads((tmp_path / layout / "result.json").read_text())
        assert run["layout"] == layout and all(code == 0 for code in run["exit_codes"].values())
        assert run["points"][0]["completed"] == 3 and (tmp_path / layout / "latency_cdf.png").is_file()
    assert "load average" in capsys.readouterr().out
