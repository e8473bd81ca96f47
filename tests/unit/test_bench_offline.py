"""Smoke test of the offline benchmark on a tiny random Llama: structure and token counts, never timings."""
from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from bench import offline, roofline
from bench.offline_report import BEGIN_MARKER, render_markdown, write_doc
from tests.tiny_models import COMMON, build_tiny_model

SYSTEMS = ["tessera", "hf_generate", "hf_cb"]
NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN = 2, 8, 4


def save_word_tokenizer(directory: Path) -> None:
    """One word per id over the tiny model's vocabulary; ids 0-2 are the special tokens LlamaConfig names."""
    specials = ["<unk>", "<s>", "</s>"]
    vocab = {tok: i for i, tok in enumerate(specials)}
    vocab.update({f"w{i}": i for i in range(len(specials), COMMON["vocab_size"])})
    raw = RawTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    hf.save_pretrained(directory)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    model_dir = build_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama"))
    save_word_tokenizer(model_dir)
    args = offline.parse_args([
        "--model", str(model_dir), "--dtypes", "float32", "--num-prompts", str(NUM_PROMPTS),
        "--input-len", str(INPUT_LEN), "--output-len", str(OUTPUT_LEN), "--systems", ",".join(SYSTEMS),
        "--hf-generate-prompts", "1", "--tessera-batched-tokens", "16,32",
        "--hf-cb-batch-tokens", "32", "--hf-cb-page-size", "16", "--hf-cb-max-requests", "1,2",
    ])
    # Timing quality is not under test: one short round per measurement keeps this fast.
    mp = pytest.MonkeyPatch()
    mp.setattr(roofline, "COPY_BYTES", 1 << 20)
    mp.setattr(roofline, "MIN_TIMED_SECONDS", 0.0)
    mp.setattr(roofline, "REPEATS", 1)
    try:
        yield offline.run(args, "python -m bench.offline (test)")
    finally:
        mp.undo()


def test_prompts_avoid_special_tokens_and_are_seeded():
    a = offline.make_prompts(50, {0, 1, 2}, 3, 16, seed=7)
    assert a == offline.make_prompts(50, {0, 1, 2}, 3, 16, seed=7)
    assert a != offline.make_prompts(50, {0, 1, 2}, 3, 16, seed=8)
    assert all(len(p) == 16 and all(3 <= t < 50 for t in p) for p in a)


def test_reproduce_command_drops_only_the_json_path():
    argv = ["--dtypes", "float32", "--out", "r.json", "--doc", "docs/b.md", "--out=x.json"]
    assert offline.reproduce_command(argv) == "python -m bench.offline --dtypes float32 --doc docs/b.md"


def test_every_system_ran_with_exact_output_counts(results):
    res = results["dtypes"]["float32"]
    assert set(res["runs"]) == set(SYSTEMS)
    expected_prompts = {"tessera": NUM_PROMPTS, "hf_cb": NUM_PROMPTS, "hf_generate": 1}
    for name, run in res["runs"].items():
        assert run["num_prompts"] == expected_prompts[name]
        assert run["output_tokens"] == expected_prompts[name] * OUTPUT_LEN
        assert run["wall_s"] > 0 and run["output_tokens_per_s"] > 0
        assert run["total_tokens_per_s"] > run["output_tokens_per_s"]
    assert [r["settings"]["max_num_batched_tokens"] for r in res["sweeps"]["tessera"]] == [16, 32]
    assert [r["settings"]["max_requests_per_batch"] for r in res["sweeps"]["hf_cb"]] == [1, 2]
    assert set(res["ratios"]) == {"tessera/hf_generate", "tessera/hf_cb"}


def test_parity_and_roofline_sections(results):
    res = results["dtypes"]["float32"]
    assert set(res["parity"]) == {"tessera_vs_hf_generate", "hf_cb_vs_hf_generate"}
    assert all(p["prompts"] == 1 for p in res["parity"].values())
    assert res["batch1"]["output_len"] == OUTPUT_LEN and res["batch1"]["bandwidth_bound_tokens_per_s"] > 0
    assert res["batch1"]["gemv_bound_tokens_per_s"] > 0
    assert res["saturation"]["model_flops"] > 0 and 0 < res["saturation"]["attention_share"] < 1
    assert [m["rows"] for m in res["roofline"]["matmul"]] == [1, NUM_PROMPTS, 16, 32]


def test_markdown_report(results, tmp_path):
    text = render_markdown(results)
    assert "python -m bench.offline (test)" in text
    assert "| float32 | tessera |" in text and "| float32 | hf_cb |" in text
    doc = tmp_path / "docs" / "benchmarks.md"
    write_doc(results, doc)
    doc.write_text(doc.read_text() + "\n## Another benchmark\n")
    write_doc(results, doc)
    text = doc.read_text()
    assert text.startswith("# Benchmarks") and text.count(BEGIN_MARKER) == 1
    assert text.rstrip().endswith("## Another benchmark")
