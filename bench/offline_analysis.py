"""What the offline benchmark's raw runs mean: ratios, output parity, and distance to the roofline.

Every function takes runs and ceilings measured in the same invocation and
returns plain dicts for the JSON results and the report.
"""
from __future__ import annotations

from bench.offline_systems import SystemRun
from bench.roofline import ModelShape, Roofline, forward_matmul_seconds

REFERENCE = "hf_generate"  # transformers' plain generate: the reference for output parity


def ratios(runs: dict[str, SystemRun]) -> dict:
    """Tessera's output tokens/s over each baseline's."""
    if "tessera" not in runs:
        return {}
    ours = runs["tessera"].output_tokens_per_s
    return {f"tessera/{name}": ours / run.output_tokens_per_s for name, run in runs.items() if name != "tessera"}


def compare_outputs(ours: list[list[int]], reference: list[list[int]]) -> dict:
    """Exact-match rate over the shared prompts, and the mean fraction of tokens before the first difference."""
    pairs = list(zip(ours, reference))
    exact = sum(a == b for a, b in pairs)
    agreed = []
    for a, b in pairs:
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        agreed.append(same / max(len(b), 1))
    return {
        "prompts": len(pairs),
        "exact": exact,
        "exact_rate": exact / len(pairs) if pairs else None,
        "mean_agreeing_prefix": sum(agreed) / len(agreed) if agreed else None,
    }


def parity(runs: dict[str, SystemRun]) -> dict:
    """Each system's greedy outputs against transformers generate, on the prompts both ran."""
    if REFERENCE not in runs:
        return {}
    reference = runs[REFERENCE].outputs
    return {
        f"{name}_vs_{REFERENCE}": compare_outputs(run.outputs[: len(reference)], reference)
        for name, run in runs.items()
        if name != REFERENCE
    }


def batch1_vs_bandwidth(measured: dict, shape: ModelShape, ceilings: Roofline) -> dict:
    """Single-request decode tokens/s against copy bandwidth / bytes read per decode step.

    A step reads every weight once plus the request's KV cache; the KV term is
    taken at the mean context of the decode phase. A second, lower ceiling is
    what torch's own one-row matmuls allow: one forward's projections and LM
    head at their measured M=1 rates, weights streamed from memory.
    """
    mean_context = measured["prompt_len"] + measured["output_len"] / 2
    kv_bytes = int(mean_context * shape.kv_bytes_per_token())
    bytes_per_step = ceilings.weight_bytes + kv_bytes
    bound = ceilings.copy_bandwidth / bytes_per_step
    one_row = next(m for m in ceilings.matmul if m["rows"] == 1)
    gemv_bound = 1 / forward_matmul_seconds(shape, one_row)
    return measured | {
        "weight_bytes": ceilings.weight_bytes,
        "kv_bytes_at_mean_context": kv_bytes,
        "bandwidth_bound_tokens_per_s": bound,
        "fraction_of_bound": measured["decode_tokens_per_s"] / bound,
        "gemv_bound_tokens_per_s": gemv_bound,
        "fraction_of_gemv_bound": measured["decode_tokens_per_s"] / gemv_bound,
    }


def saturation_vs_matmul(run: SystemRun | None, shape: ModelShape, ceilings: Roofline) -> dict | None:
    """The full run's FLOP rate against the best measured matmul rate.

    Tokens through the decoder per request: the prompt plus every generated
    token but the last (it is never fed back); logits per request: one per
    generated token. Prompt tokens count because they cost FLOPs.
    """
    if run is None:
        return None
    decoder_tokens = run.num_prompts * (run.input_len + run.output_len - 1)
    logit_tokens = run.num_prompts * run.output_len
    flops = shape.flops(decoder_tokens, logit_tokens)
    # Mean context over every token that attends: prompt tokens see half the prompt on average.
    contexts = run.input_len * run.input_len / 2 + (run.output_len - 1) * (run.input_len + run.output_len / 2)
    attention = run.num_prompts * shape.attention_flops(1) * contexts
    peak = ceilings.peak_matmul_flops
    achieved = flops / run.wall_s
    flops_per_output_token = flops / run.output_tokens
    return {
        "model_flops": flops,
        "flops_per_output_token": flops_per_output_token,
        "attention_flops_excluded": attention,
        "attention_share": attention / (attention + flops),
        "achieved_flops_per_s": achieved,
        "peak_matmul_flops_per_s": peak,
        "roofline_output_tokens_per_s": peak / flops_per_output_token,
        "output_tokens_per_s": run.output_tokens_per_s,
        "fraction_of_roofline": achieved / peak,
    }
