"""bench/sampler.py: the baseline draws only what its filters keep, and the table has a row per point."""
from __future__ import annotations

import torch

from bench import sampler as bench_sampler
from common.engine.sampler import SamplingRow, apply_penalties, processed_probs
from common.protocol.sampling_params import SamplingParams


def test_the_baseline_draws_within_the_support_tessera_keeps():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(1, 400, generator=gen).expand(500, -1).contiguous() * 3
    prompt, output = torch.tensor([3, 5, 8]), torch.tensor([5, 5, 9, 1])
    for params in bench_sampler.SETTINGS.values():
        tokens = bench_sampler.race(logits, params, gen, prompt.expand(500, -1), output.expand(500, -1))
        support = processed_probs(logits[:1], [SamplingRow(params, prompt, output.tolist(), 0)])[0] > 0
        assert bool(support[tokens].all()), params
        if not params.greedy:
            assert len(set(tokens.tolist())) > 1, params
    top_k = bench_sampler.race(logits, SamplingParams(temperature=1.0, top_k=3), gen)
    assert set(top_k.tolist()) <= set(logits[0].topk(3).indices.tolist())


def test_the_table_has_a_row_per_setting_and_size(capsys):
    assert bench_sampler.main(["--rows", "1", "3", "--vocab", "300", "--repeat", "2", "--threads", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "300" in line]
    assert len(rows) == 2 * len(bench_sampler.SETTINGS) and all(line.endswith("x |") for line in rows)


def test_the_baselines_penalties_are_tesseras():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 50, generator=gen)
    prompts, outputs = torch.randint(0, 50, (3, 6), generator=gen), torch.randint(0, 50, (3, 5), generator=gen)
    params = SamplingParams(temperature=0.0, frequency_penalty=0.5, presence_penalty=0.25, repetition_penalty=1.3)
    rows = [SamplingRow(params, prompts[i], outputs[i].tolist(), 0) for i in range(3)]
    expected = apply_penalties(logits, rows).argmax(-1)
    assert torch.equal(bench_sampler.race(logits, params, gen, prompts, outputs), expected)
