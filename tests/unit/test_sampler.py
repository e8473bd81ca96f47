"""Sampler: filters against a per-row reference, penalties by hand, reproducible draws."""
from __future__ import annotations

import math

import pytest
import torch

from common.engine import sampler as sampler_module
from common.engine.counter_rng import counter_uniform64, counter_uniforms
from common.engine.sampler import Sampler, SamplingRow, apply_penalties, draw, processed_probs
from common.protocol.sampling_params import SamplingParams


def row(seed: int = 0, output: list[int] | None = None, prompt: list[int] | None = None, **params) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), [] if prompt is None else prompt, output or [], seed)


def chi_square_critical(dof: int, z: float = 4.75) -> float:
    """Wilson-Hilferty upper quantile of chi-square; z = 4.75 is about p = 1e-6."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Statistic and degrees of freedom over the cells with nonzero probability."""
    n = counts.sum()
    support = probs > 0
    expected = probs[support] * n
    return float(((counts[support] - expected) ** 2 / expected).sum()), int(support.sum()) - 1


# ---- the counter RNG -----------------------------------------------------------

MASK64 = 2**64 - 1


def splitmix64_reference(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def uniform_reference(seed: int, counter: int, column: int) -> float:
    gamma = 0x9E3779B97F4A7C15
    key = splitmix64_reference((splitmix64_reference(seed & MASK64) + (counter + 1) * gamma) & MASK64)
    z = splitmix64_reference((key + (column + 1) * gamma) & MASK64)
    return ((z >> 41) + 0.5) / 2**23


def test_uniforms_are_splitmix64_with_wraparound():
    seeds = [0, 1, 2**62 + 12345, 2**63 - 1, -(2**63), -7]  # int64 views of uint64 seeds
    counters = [0, 1, 17, 5000, 2**31, 3]
    columns = [0, 1, 2, 1000, 49151, 2**20]
    got = counter_uniforms(torch.tensor(seeds), torch.tensor(counters), torch.tensor(columns))
    for i, (seed, counter) in enumerate(zip(seeds, counters)):
        for j, column in enumerate(columns):
            assert got[i, j].item() == uniform_reference(seed, counter, column)


def test_the_row_uniform_is_splitmix64s_whole_output():
    seeds = [0, 1, 2**62 + 12345, 2**63 - 1, -(2**63), -7]
    counters = [0, 1, 17, 5000, 2**31, 3]
    gamma = 0x9E3779B97F4A7C15
    for column in (0, 49152):
        got = counter_uniform64(torch.tensor(seeds), torch.tensor(counters), column)
        assert got.dtype is torch.float64
        for i, (seed, counter) in enumerate(zip(seeds, counters)):
            key = splitmix64_reference((splitmix64_reference(seed & MASK64) + (counter + 1) * gamma) & MASK64)
            z = splitmix64_reference((key + (column + 1) * gamma) & MASK64)
            assert got[i].item() == ((z >> 12) + 0.5) / 2**52
            # the float32 uniform of the same coordinates is its top 23 bits
            assert math.floor(got[i].item() * 2**23) + 0.5 == uniform_reference(seed, counter, column) * 2**23


def test_uniforms_look_uniform_and_uncorrelated():
    seeds, steps = torch.arange(64), torch.arange(64) * 3
    u = counter_uniforms(seeds, steps, torch.arange(16384)).double()
    n = u.numel()
    sigma_mean = math.sqrt(1 / 12 / n)
    assert abs(u.mean().item() - 0.5) < 5 * sigma_mean
    assert abs(u.var().item() - 1 / 12) < 0.002
    histogram = torch.histc(u, bins=100, min=0.0, max=1.0)
    statistic, dof = chi_square(histogram, torch.full((100,), 0.01, dtype=torch.float64))
    assert statistic < chi_square_critical(dof)

    def correlation(a: torch.Tensor, b: torch.Tensor) -> float:
        return torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1].item()

    bound = 5 / math.sqrt(n)  # five standard errors of a zero correlation
    assert abs(correlation(u[:, :-1], u[:, 1:])) < bound  # neighbouring vocab ids
    next_step = counter_uniforms(seeds, steps + 1, torch.arange(16384)).double()
    assert abs(correlation(u, next_step)) < bound  # consecutive generation indices
    next_seed = counter_uniforms(seeds + 1, steps, torch.arange(16384)).double()
    assert abs(correlation(u, next_seed)) < bound  # neighbouring seeds


# ---- reproducibility and the empirical distribution ---------------------------


@pytest.mark.parametrize("chunk_rows", [2, 1000])  # CPU row chunks of the stochastic rows
def test_seeded_draw_ignores_batch_neighbours_and_position(chunk_rows, monkeypatch):
    vocab = 500
    monkeypatch.setattr(sampler_module, "_CPU_CHUNK_ELEMENTS", chunk_rows * vocab)
    torch.manual_seed(0)
    logits = torch.randn(1, vocab)
    target = row(seed=1234, output=[1, 2, 3], temperature=1.0)
    alone = Sampler()(logits, [target]).token_ids[0]

    others = [row(seed=s, output=[5] * s, temperature=0.7, top_p=0.9) for s in range(6)]
    others.insert(2, row(temperature=0.0))
    for position in (0, 3, len(others)):
        rows = others[:position] + [target] + others[position:]
        batch = torch.randn(len(rows), vocab)
        batch[position] = logits[0]
        assert Sampler()(batch, rows).token_ids[position] == alone


def test_different_seeds_and_steps_draw_differently():
    logits = torch.zeros(200, 1000)  # uniform over 1000 tokens
    by_seed = Sampler()(logits, [row(seed=s) for s in range(200)]).token_ids
    by_step = Sampler()(logits, [row(seed=7, output=[0] * s) for s in range(200)]).token_ids
    # 200 uniform draws from 1000 collide about 18 times on average.
    assert len(set(by_seed)) > 150
    assert len(set(by_step)) > 150


def test_seeds_beyond_int64_are_taken_modulo_2_64():
    logits = torch.zeros(1, 1000)
    assert Sampler()(logits, [row(seed=2**64 + 99)]).token_ids == Sampler()(logits, [row(seed=99)]).token_ids


def test_draws_follow_softmax_of_tempered_logits():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, -4.0])
    temperature, draws = 0.7, 40000
    rows = [row(seed=s, output=[0] * (s % 3), temperature=temperature) for s in range(draws)]
    tokens = torch.tensor(Sampler()(logits.expand(draws, -1), rows).token_ids)
    counts = torch.bincount(tokens, minlength=len(logits)).double()
    expected = (logits / temperature).softmax(-1).double()
    statistic, dof = chi_square(counts, expected)
    assert statistic < chi_square_critical(dof)
    total_variation = 0.5 * (counts / draws - expected).abs().sum().item()
    assert total_variation < 0.01


def reference_draw(probs: torch.Tensor, seed: int, step: int, block: int) -> int:
    """One row's two-round race, the obvious way: the blocks' masses against their uniforms, then the winning
    block's tokens against theirs (columns: a token's id; a block's vocab + 1 + its index)."""
    vocab = probs.shape[0]
    blocks = -(-vocab // block)
    seeds, steps = torch.tensor([seed]), torch.tensor([step])
    masses = torch.stack([probs[b * block:(b + 1) * block].sum() for b in range(blocks)])
    exponentials = -counter_uniforms(seeds, steps, torch.arange(vocab + 1, vocab + 1 + blocks))[0].log()
    won = int((masses / exponentials).argmax())
    ids = torch.arange(won * block, min(vocab, (won + 1) * block))
    return int(ids[(probs[ids] / -counter_uniforms(seeds, steps, ids)[0].log()).argmax()])


@pytest.mark.parametrize("vocab", [3, 256, 700, 4096, 151936])
def test_draw_takes_given_uniform_coordinates(vocab):
    gen = torch.Generator().manual_seed(vocab)
    rows = 24
    probs = processed_probs(torch.randn(rows, vocab, generator=gen) * 3,
                            [row(temperature=1.0, top_k=[0, 1, 5, 300][i % 4]) for i in range(rows)])
    seeds, steps = torch.arange(rows) * 7919, torch.arange(rows) % 5
    expected = [reference_draw(probs[i], int(seeds[i]), int(steps[i]), sampler_module._DRAW_BLOCK)
                for i in range(rows)]
    drawn = draw(probs, seeds, steps)
    assert drawn.tolist() == expected
    assert bool((probs.gather(1, drawn[:, None]) > 0).all())


def test_draws_across_blocks_follow_the_distribution():
    """Mass spread over several blocks, unevenly, and a block of zero mass: the two rounds draw each token with its
    probability (and a block with its mass)."""
    vocab, draws = 5 * sampler_module._DRAW_BLOCK + 40, 60000
    gen = torch.Generator().manual_seed(3)
    logits = torch.full((vocab,), -math.inf)
    picked = torch.randperm(vocab, generator=gen)[:60]
    picked = picked[picked // sampler_module._DRAW_BLOCK != 2]  # block 2 holds nothing
    logits[picked] = torch.randn(len(picked), generator=gen)
    probs = logits.softmax(-1)
    rows = probs.expand(draws, -1)
    tokens = draw(rows, torch.arange(draws) * 31 + 5, torch.arange(draws) % 7)
    counts = torch.bincount(tokens, minlength=vocab).double()
    statistic, dof = chi_square(counts, probs.double())
    assert statistic < chi_square_critical(dof)
    assert counts[2 * sampler_module._DRAW_BLOCK:3 * sampler_module._DRAW_BLOCK].sum() == 0


# ---- filters -------------------------------------------------------------------


def reference_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """One row, the obvious way: temperature, min_p, top_k, top_p over a full sort."""
    x = logits.double() / params.temperature
    if params.min_p > 0:
        p = x.softmax(-1)
        x = x.masked_fill(p < params.min_p * p.max(), -math.inf)
    if params.top_k > 0:
        kth = x.sort(descending=True).values[min(params.top_k, len(x)) - 1]
        x = x.masked_fill(x < kth, -math.inf)
    if params.top_p < 1.0:
        values, order = x.sort(descending=True)
        p = values.softmax(-1)
        mass_before = p.cumsum(-1) - p
        drop = torch.zeros_like(x, dtype=torch.bool)
        drop[order] = mass_before >= params.top_p
        drop[order[0]] = False
        x = x.masked_fill(drop, -math.inf)
    return x.softmax(-1).float()


def test_top_k_keeps_exactly_k_tokens_renormalized():
    logits = torch.linspace(3, -3, 20)[torch.randperm(20, generator=torch.Generator().manual_seed(0))]
    probs = processed_probs(logits[None], [row(top_k=5, temperature=0.8)])[0]
    kept = probs.nonzero().flatten()
    assert set(kept.tolist()) == set(logits.topk(5).indices.tolist())
    torch.testing.assert_close(probs[kept], (logits[kept] / 0.8).softmax(-1))


def test_top_p_keeps_the_minimal_nucleus():
    logits = torch.tensor([0.5, 0.25, 0.15, 0.1]).log()
    def nucleus(top_p: float) -> list[int]:
        return processed_probs(logits[None], [row(top_p=top_p)])[0].nonzero().flatten().tolist()
    assert nucleus(0.4) == [0]
    assert nucleus(0.7) == [0, 1]
    assert nucleus(0.8) == [0, 1, 2]
    assert nucleus(0.95) == [0, 1, 2, 3]
    probs = processed_probs(logits[None], [row(top_p=0.7)])[0]
    torch.testing.assert_close(probs[:2], torch.tensor([2 / 3, 1 / 3]))


def test_min_p_drops_tokens_below_a_fraction_of_the_top():
    logits = torch.tensor([0.4, 0.3, 0.2, 0.06, 0.04]).log()
    probs = processed_probs(logits[None], [row(min_p=0.125)])[0]
    assert probs.nonzero().flatten().tolist() == [0, 1, 2, 3]  # 0.04 < 0.125 * 0.4 = 0.05
    torch.testing.assert_close(probs[:4], torch.tensor([0.4, 0.3, 0.2, 0.06]) / 0.96)


@pytest.mark.parametrize("ladder", [(256, 4096), (8, 64)])  # top_p's candidate counts
@pytest.mark.parametrize("scale", [0.5, 3.0, 8.0])  # flat to peaked: nuclei of every size
def test_filters_match_a_per_row_reference(scale, ladder, monkeypatch):
    monkeypatch.setattr(sampler_module, "_TOP_P_CANDIDATES", ladder)
    generator = torch.Generator().manual_seed(int(scale * 10))
    vocab, batch = 1000, 24
    logits = torch.randn(batch, vocab, generator=generator) * scale
    choices = torch.rand(batch, 4, generator=generator).tolist()
    params = [
        SamplingParams(
            temperature=0.3 + c[0],
            top_k=[0, 1, 7, 300, 2000][int(c[1] * 5)],
            top_p=[1.0, 0.95, 0.6, 0.2][int(c[2] * 4)],
            min_p=[0.0, 0.0, 0.01, 0.2][int(c[3] * 4)],
        )
        for c in choices
    ]
    rows = [SamplingRow(p, [], [], seed=i) for i, p in enumerate(params)]
    got = processed_probs(logits, rows)
    for i, p in enumerate(params):
        if p.greedy:
            assert got[i].argmax() == logits[i].argmax() and got[i].max() == 1.0
        else:
            torch.testing.assert_close(got[i], reference_probs(logits[i], p), atol=1e-6, rtol=1e-4)


def test_draws_never_leave_the_filtered_support():
    logits = torch.randn(1, 300, generator=torch.Generator().manual_seed(3)).expand(2000, -1)
    rows = [row(seed=s, top_k=10, top_p=0.8) for s in range(2000)]
    tokens = set(Sampler()(logits, rows).token_ids)
    support = set(processed_probs(logits[:1], rows[:1])[0].nonzero().flatten().tolist())
    assert tokens <= support and len(tokens) > 1


# ---- penalties -----------------------------------------------------------------


def test_penalties_match_hand_computed_values():
    logits = torch.tensor([[1.0, -1.0, 2.0, 0.5, -0.5], [1.0, -1.0, 2.0, 0.5, -0.5]])
    rows = [
        row(prompt=[0], output=[1, 2, 2], repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
        row(prompt=[0], output=[1, 2, 2]),  # no penalties: untouched
    ]
    original = logits.clone()
    got = apply_penalties(logits, rows)
    # 0: prompt only, repetition: 1/2. 1: -1*2 - 0.5*1 - 0.25. 2: 2/2 - 0.5*2 - 0.25.
    torch.testing.assert_close(got[0], torch.tensor([0.5, -2.75, -0.25, 0.5, -0.5]))
    torch.testing.assert_close(got[1], original[1])
    assert torch.equal(logits, original)


def dense_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The penalties over every logit of every row: a histogram of each row's tokens, then whole-row operations."""
    out = logits.clone()
    for i, r in enumerate(rows):
        if not r.params.needs_penalties:
            continue
        counts = torch.bincount(torch.tensor(list(r.output_token_ids), dtype=torch.long),
                                minlength=logits.shape[1]).float()
        seen = counts > 0
        seen[torch.as_tensor(r.prompt_token_ids, dtype=torch.long)] = True
        rep = torch.tensor(r.params.repetition_penalty)
        x = torch.where(seen, torch.where(out[i] > 0, out[i] / rep, out[i] * rep), out[i])
        x -= torch.tensor(r.params.frequency_penalty) * counts
        x -= torch.tensor(r.params.presence_penalty) * (counts > 0)
        out[i] = x
    return out


def test_penalties_touch_only_seen_tokens_and_equal_the_dense_pass_bit_for_bit():
    gen = torch.Generator().manual_seed(4)
    vocab = 3000
    logits = torch.randn(9, vocab, generator=gen) * 4
    logits[2, 7] = -math.inf  # a token a grammar masked
    ids = torch.randint(0, vocab, (9, 400), generator=gen).tolist()
    rows = [row(prompt=ids[i][:300], output=ids[i][300:300 + 10 * i], repetition_penalty=(1.0, 1.3, 0.8)[i % 3],
                frequency_penalty=(0.0, 0.7, -0.4)[i % 3] if i != 4 else 0.0,
                presence_penalty=(0.2, 0.0, 1.1)[i % 3] if i != 5 else 0.0) for i in range(8)]
    rows.append(row(prompt=[7, 8], output=[7, 7, 9], temperature=0.5))  # no penalties: untouched
    rows[2] = row(prompt=torch.tensor([7, 11, 12]), output=[7, 13, 13], repetition_penalty=1.2,
                  frequency_penalty=0.3)  # the prompt as its distinct ids, as the model runner passes it
    got = apply_penalties(logits, rows)
    assert torch.equal(got, dense_penalties(logits, rows))
    assert torch.equal(got[8], logits[8]) and got[2, 7].item() == -math.inf


def test_token_ids_outside_the_vocab_are_rejected():
    with pytest.raises(ValueError, match="outside the logits' vocab"):
        apply_penalties(torch.zeros(2, 5), [row(output=[5], presence_penalty=1.0), row(presence_penalty=1.0)])
    with pytest.raises(ValueError, match="token id -1 outside"):
        apply_penalties(torch.zeros(1, 5), [row(prompt=[-1], repetition_penalty=1.5)])


# ---- greedy and logprobs -------------------------------------------------------


def test_greedy_takes_the_argmax_of_penalized_logits():
    logits = torch.tensor([[3.0, 2.9, 0.0], [3.0, 2.9, 0.0], [0.0, 1.0, 5.0]])
    rows = [
        row(temperature=0.0),
        row(temperature=0.0, output=[0], repetition_penalty=1.5),  # 3.0 / 1.5 < 2.9
        row(top_k=1, temperature=1.3),
    ]
    assert Sampler()(logits, rows).token_ids == [0, 1, 2]


def test_all_greedy_batch_takes_the_argmax_fast_path(monkeypatch):
    def fail(*_):
        raise AssertionError("the all-greedy fast path must not build distributions")

    monkeypatch.setattr(sampler_module, "processed_probs", fail)
    logits = torch.randn(6, 50, dtype=torch.bfloat16)
    out = Sampler()(logits, [row(temperature=0.0) for _ in range(6)])
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs is None and out.top_logprobs is None


def test_logprobs_come_from_the_raw_logits_sorted():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(1))
    rows = [
        row(seed=1, output=[3, 3], temperature=0.5, repetition_penalty=1.7, frequency_penalty=1.0, logprobs=4),
        row(temperature=0.0),
        row(seed=2, top_k=3, logprobs=0),
    ]
    out = Sampler()(logits, rows)
    raw = logits.log_softmax(-1)
    for i in (0, 2):
        assert out.logprobs[i] == pytest.approx(raw[i, out.token_ids[i]].item(), abs=1e-6)
    top_values, top_ids = raw[0].topk(4)
    assert [t for t, _ in out.top_logprobs[0]] == top_ids.tolist()
    assert [v for _, v in out.top_logprobs[0]] == pytest.approx(top_values.tolist(), abs=1e-6)
    assert all(a[1] >= b[1] for a, b in zip(out.top_logprobs[0], out.top_logprobs[0][1:]))
    assert math.isnan(out.logprobs[1]) and out.top_logprobs[1] == []
    assert out.top_logprobs[2] == []


def test_no_logprobs_requested_gives_none():
    out = Sampler()(torch.randn(2, 10), [row(seed=1), row(temperature=0.0, presence_penalty=0.5)])
    assert out.logprobs is None and out.top_logprobs is None


def test_row_count_must_match_logits():
    with pytest.raises(ValueError, match="2 logit rows but 1 sampling rows"):
        Sampler()(torch.zeros(2, 4), [row()])
