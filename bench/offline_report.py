"""Markdown rendering of ``bench.offline`` results; every number comes from the results dict."""
from __future__ import annotations

from pathlib import Path

from bench.doc_sections import replace_section
from bench.offline_systems import WARMUP_OUTPUT_LEN, WARMUP_PROMPTS
from bench.roofline import COPY_BYTES, REPEATS

TARGET_RATIO = 3.0  # the issue's target: Tessera >= 3x transformers' continuous batching
SYSTEM_ORDER = ("tessera", "hf_cb", "hf_generate")
# Other benchmarks may share the document: only the text between the markers is this one's.
BEGIN_MARKER = "<!-- bench.offline: generated, re-run the command below instead of editing -->"
END_MARKER = "<!-- /bench.offline -->"
DOC_HEADER = "# Benchmarks\n"
SWEPT_SETTING = {"tessera": "max_num_batched_tokens", "hf_cb": "max_requests_per_batch"}

METHOD_NOTES = f"""\
- Prompts are seeded random token ids of exactly the input length, drawn from the vocabulary without
  special tokens, identical for every system. Every request generates exactly the output length,
  greedy: Tessera with `ignore_eos`, transformers with an EOS id no token can take (-1), so EOS is
  neither a stop nor masked and the outputs stay comparable token for token.
- Each system is built once per dtype (model load and KV cache allocation are not timed), warmed up
  on a short run of {WARMUP_PROMPTS} other prompts ({WARMUP_OUTPUT_LEN} output tokens, not timed), then timed
  on one run of the workload. Wall time is the whole offline call: submission to the last output.
- transformers `generate` runs one prompt at a time on the first prompts only; its tokens/s is over
  the prompts it ran, which equals what it would sustain on all of them (independent, same-length
  requests).
- transformers continuous batching is `generate_batch` with `attn_implementation="sdpa"` (its paged
  implementation on CPU; flash attention does not exist there), a persistent manager so the cache
  built for the warm-up is reused, and an explicit `ContinuousBatchingConfig` (see Configurations)
  instead of its CPU defaults, which size the cache from 60% of free RAM and its per-step attention
  mask with it. On CPU its SDPA attends over the keys of every request in the step at once behind a
  block-diagonal mask, so a decode step's cost grows with the square of the number of requests in it;
  `max_requests_per_batch` is therefore kept small (`--hf-cb-max-requests`; in shorter trials 8 and
  16 were within a few percent, 32 was slower and 64 several times slower).
- Throughput ratios compare output tokens/s measured in the same invocation.
- Copy bandwidth = (bytes read + bytes written) / time of a {COPY_BYTES >> 20} MiB `torch` tensor copy, best
  of {REPEATS} (STREAM "copy" convention: write-allocate traffic is not counted). The batch-1 bound is that
  bandwidth divided by the bytes one decode step reads: every weight once (the tied embedding counted
  once, as the LM head) plus the request's KV cache at the mean decode context.
- Matmul FLOP/s = 2·M·K·N / time of `F.linear` over one decoder layer's real GEMM shapes (fused qkv,
  o, fused gate/up, down) and the LM head at M rows, in the model's dtype, best of {REPEATS}, each call on
  a different copy of the weight ({COPY_BYTES >> 20} MiB of copies per shape) so that weights come from
  memory, as in a forward pass, not from the cache. The "torch M=1 matmul bound" is one forward's
  projections and LM head at their measured M=1 rates: what torch's own one-row matmuls allow, below
  the copy-bandwidth bound when they read memory more slowly than a copy does.
- The saturation roofline uses the best layer-mix rate over the measured M values.
- FLOPs per request = 2 × non-embedding params × (input + output − 1) tokens through the decoder
  + 2 × vocab × hidden × output tokens of logits; prompt tokens count because they cost FLOPs.
  Attention score/value FLOPs are left out of the roofline; their share is given.
"""


def _fmt(value: float, digits: int = 1) -> str:
    return f"{value:,.{digits}f}"


def _machine_line(results: dict) -> str:
    m = results["machine"]
    cpu = m["cpu"]
    parts = [
        f"{cpu.get('Model name', 'unknown CPU')}",
        f"{m['nproc']} CPUs ({cpu.get('Core(s) per socket', '?')} cores/socket, "
        f"{cpu.get('Thread(s) per core', '?')} thread/core)",
        f"L2 {cpu.get('L2 cache', '?')}, L3 {cpu.get('L3 cache', '?')}",
        f"{m['memory_gib']:.1f} GiB RAM" if m.get("memory_gib") else "RAM unknown",
        "ISA " + " ".join(m["isa"]),
    ]
    if cpu.get("Hypervisor vendor"):
        parts.append(f"VM ({cpu['Hypervisor vendor']})")
    return "; ".join(parts) + f". Python {m['python']}, torch {m['torch']}, transformers {m['transformers']}."


def _throughput_table(results: dict) -> list[str]:
    lines = ["| dtype | system | prompts timed | wall s | output tok/s | total tok/s | Tessera ÷ system |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for dtype, res in results["dtypes"].items():
        for name in (n for n in SYSTEM_ORDER if n in res["runs"]):
            run = res["runs"][name]
            ratio = res["ratios"].get(f"tessera/{name}")
            timed = str(run["num_prompts"])
            if name == "hf_generate":
                timed += f" of {results['workload']['num_prompts']}, one at a time"
            lines.append(
                f"| {dtype} | {name} | {timed} | {_fmt(run['wall_s'])} | {_fmt(run['output_tokens_per_s'])} | "
                f"{_fmt(run['total_tokens_per_s'])} | {'—' if ratio is None else _fmt(ratio, 2) + '×'} |"
            )
    return lines


def _target_lines(results: dict) -> list[str]:
    lines = []
    for dtype, res in results["dtypes"].items():
        ratio = res["ratios"].get("tessera/hf_cb")
        if ratio is not None:
            verdict = "met" if ratio >= TARGET_RATIO else "not met"
            lines.append(f"- {dtype}: Tessera = {_fmt(ratio, 2)}× transformers continuous batching "
                         f"(target ≥ {TARGET_RATIO:g}×: {verdict}).")
    return lines


def _sweep_table(results: dict) -> list[str]:
    lines = ["| dtype | system | setting | wall s | output tok/s | preemptions |", "|---|---|---|---:|---:|---:|"]
    for dtype, res in results["dtypes"].items():
        for name, sweep in res["sweeps"].items():
            key = SWEPT_SETTING[name]
            best = min(run["wall_s"] for run in sweep)
            for run in sweep:
                mark = " (compared)" if run["wall_s"] == best else ""
                lines.append(f"| {dtype} | {name} | {key}={run['settings'][key]}{mark} | {_fmt(run['wall_s'])} | "
                             f"{_fmt(run['output_tokens_per_s'])} | {run['num_preemptions']} |")
    return lines if len(lines) > 2 else []


def _parity_table(results: dict) -> list[str]:
    lines = ["| dtype | outputs compared | prompts | identical | mean agreeing prefix |", "|---|---|---:|---:|---:|"]
    for dtype, res in results["dtypes"].items():
        for pair, p in res["parity"].items():
            lines.append(f"| {dtype} | {pair.replace('_vs_', ' vs ')} | {p['prompts']} | "
                         f"{p['exact']} ({p['exact_rate']:.0%}) | {p['mean_agreeing_prefix']:.1%} |")
    return lines


def _batch1_table(results: dict) -> list[str]:
    lines = [
        "| dtype | copy GB/s | bytes/step MiB | decode tok/s | bandwidth bound tok/s | % of it | "
        "torch M=1 matmul bound tok/s | % of it |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for dtype, res in results["dtypes"].items():
        b1 = res["batch1"]
        if b1:
            step_mib = (b1["weight_bytes"] + b1["kv_bytes_at_mean_context"]) / 2**20
            lines.append(
                f"| {dtype} | {res['roofline']['copy_bandwidth'] / 1e9:.1f} | {_fmt(step_mib)} | "
                f"{_fmt(b1['decode_tokens_per_s'])} | {_fmt(b1['bandwidth_bound_tokens_per_s'])} | "
                f"{b1['fraction_of_bound']:.0%} | {_fmt(b1['gemv_bound_tokens_per_s'])} | "
                f"{b1['fraction_of_gemv_bound']:.0%} |"
            )
    return lines if len(lines) > 2 else []


def _saturation_table(results: dict) -> list[str]:
    lines = [
        "| dtype | matmul GFLOP/s by rows M | GFLOP/output token | attention FLOPs left out | output tok/s | "
        "matmul roofline tok/s | % of it |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for dtype, res in results["dtypes"].items():
        sat = res["saturation"]
        if sat:
            matmul = ", ".join(f"{m['rows']}: {m['layer_mix'] / 1e9:.0f}" for m in res["roofline"]["matmul"])
            lines.append(
                f"| {dtype} | {matmul} | {sat['flops_per_output_token'] / 1e9:.2f} | {sat['attention_share']:.0%} | "
                f"{_fmt(sat['output_tokens_per_s'])} | {_fmt(sat['roofline_output_tokens_per_s'])} | "
                f"{sat['fraction_of_roofline']:.0%} |"
            )
    return lines if len(lines) > 2 else []


def _settings_lines(results: dict) -> list[str]:
    lines = []
    for dtype, res in results["dtypes"].items():
        for name in (n for n in SYSTEM_ORDER if n in res["runs"]):
            settings = ", ".join(f"{k}={v}" for k, v in res["runs"][name]["settings"].items())
            lines.append(f"- {dtype} {name}: {settings}")
    return lines


def render_summary(results: dict) -> str:
    """The tables alone, for the terminal."""
    blocks = [_throughput_table(results), _target_lines(results), _sweep_table(results), _parity_table(results),
              _batch1_table(results), _saturation_table(results)]
    return "\n\n".join("\n".join(b) for b in blocks if b) + "\n"


def render_markdown(results: dict, heading_level: int = 2) -> str:
    """The benchmark as a markdown section: command, machine, tables, ratios, roofline, method."""
    w = results["workload"]
    h, sub = "#" * heading_level, "#" * (heading_level + 1)
    load_start, load_end = results["load_average_start"], results["load_average_end"]
    out = [
        f"{h} Offline throughput: {w['num_prompts']} prompts × {w['input_len']} input / {w['output_len']} output "
        f"tokens, greedy, {w['threads']} threads",
        "",
        "Reproduce (from the repository root, in the project's virtualenv):",
        "",
        f"    {results['command']}",
        "",
        f"Machine: {_machine_line(results)}",
        "",
        f"Load average (1/5/15 min) at start {' / '.join(f'{x:.2f}' for x in load_start)}, at end "
        f"{' / '.join(f'{x:.2f}' for x in load_end)}; the whole run took {results['elapsed_s'] / 60:.1f} min.",
        "",
        f"{sub} Throughput", "", *_throughput_table(results), "", *_target_lines(results), "",
        f"{sub} Settings swept in this run", "",
        "Each system was timed once per value; its fastest run is the one compared above.", "",
        *_sweep_table(results), "",
        f"{sub} Greedy output parity with transformers `generate`", "", *_parity_table(results), "",
        f"{sub} Batch 1 against memory bandwidth", "",
        "One request alone through Tessera (a prompt of the input length, not one of the timed ones); decode "
        "tokens/s after the first token.", "",
        *_batch1_table(results), "",
        f"{sub} Saturation against the matmul roofline", "",
        "The full Tessera run above; the roofline is the best layer-mix matmul rate over the measured M.", "",
        *_saturation_table(results), "",
        f"{sub} Configurations", "", *_settings_lines(results), "",
        f"{sub} Method", "", METHOD_NOTES,
    ]
    return "\n".join(out)


def write_doc(results: dict, path: Path) -> None:
    """Put the section into ``path`` between its markers, replacing a previous one and keeping the rest."""
    replace_section(path, BEGIN_MARKER, END_MARKER, render_markdown(results), empty=DOC_HEADER)
