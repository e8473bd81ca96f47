"""Speculative sampling at temperature > 0 is lossless: statistical tests.

1. The verification rule alone: with fixed target rows p and drafts drawn
   from q, the first emitted token is distributed as p (chi-square goodness
   of fit against the exact p), for one-hot (n-gram) and full (draft) q.
2. The whole engine on a tiny model: the joint distribution of the four
   generated tokens with n-gram and draft-model speculation equals the
   plain engine's (chi-square test of homogeneity).

Each test uses a significance level of 1e-3; the seeds are fixed, so a pass
is reproducible, and a wrong rule (e.g. accepting every draft) fails by many
orders of magnitude (checked in the last test, which shows the tests have power).
"""
from __future__ import annotations

import collections
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.config.base import EngineConfig
from common.engine.llm_engine import LLMEngine
from common.protocol.sampling_params import SamplingParams
from common.engine.sequence import Sequence
from common.engine.spec_verify import verify_drafts
from tests.tiny_models import build_tiny_model

ALPHA = 1e-3
VOCAB = 6


def chi2_pvalue(statistic: float, dof: int) -> float:
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


def goodness_of_fit(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token outside the target's support was emitted"
    stat = float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    return chi2_pvalue(stat, int(keep.sum()) - 1)


def homogeneity(a: collections.Counter, b: collections.Counter, min_expected: float = 5.0) -> float:
    """Two-sample chi-square; cells with small expected counts are pooled into one."""
    na, nb = sum(a.values()), sum(b.values())
    cells, pooled = [], [0, 0]
    for key in set(a) | set(b):
        row = (a[key], b[key])
        if (row[0] + row[1]) * min(na, nb) / (na + nb) < min_expected:
            pooled[0] += row[0]
            pooled[1] += row[1]
        else:
            cells.append(row)
    if sum(pooled):
        cells.append(tuple(pooled))
    stat = 0.0
    for ca, cb in cells:
        total = ca + cb
        for observed, n in ((ca, na), (cb, nb)):
            expected = total * n / (na + nb)
            stat += (observed - expected) ** 2 / expected
    return chi2_pvalue(stat, len(cells) - 1)


def rows_for(count: int, k: int, params: SamplingParams) -> list[Sequence]:
    return [Sequence(f"r{i}", [1, 2, 3], params, seed=1000 + i) for i in range(count)]


def first_tokens(p_logits, q_probs, n_gram: bool, count=20000, k=2, accept_all=False):
    """Verify ``count`` independently drafted sequences; histogram of the first emitted token."""
    params = SamplingParams(temperature=1.0)
    seqs = rows_for(count, k, params)
    gen = torch.Generator().manual_seed(0)
    if n_gram:  # a deterministic proposal: the same guessed tokens every time
        drafts = [[2, 4] for _ in range(count)]
        draft_probs = [None] * count
    else:
        drafted = torch.multinomial(q_probs, count, replacement=True, generator=gen).T  # [count, k]
        drafts = drafted.tolist()
        draft_probs = [q_probs] * count
    logits = p_logits.repeat(count, 1)
    if accept_all:
        return torch.bincount(torch.tensor([d[0] for d in drafts]), minlength=VOCAB).double()
    out = verify_drafts(logits, seqs, drafts, draft_probs)
    assert all(1 <= len(t) <= k + 1 for t in out.token_ids)
    return torch.bincount(torch.tensor([t[0] for t in out.token_ids]), minlength=VOCAB).double()


P_LOGITS = torch.tensor([[2.0, 0.5, 1.0, -1.0, 0.0, 1.5], [0.1, 0.2, 0.3, 2.0, -0.5, 1.0],
                         [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
Q = torch.tensor([[0.05, 0.1, 0.5, 0.05, 0.2, 0.1], [0.3, 0.1, 0.1, 0.1, 0.3, 0.1]])


@pytest.mark.parametrize("n_gram", [True, False], ids=["ngram-q", "draft-q"])
def test_the_first_emitted_token_follows_the_target(n_gram):
    counts = first_tokens(P_LOGITS, Q, n_gram)
    p0 = P_LOGITS[0].softmax(-1).double()
    p_value = goodness_of_fit(counts, p0)
    print(f"first-token chi-square p = {p_value:.3g} ({'n-gram' if n_gram else 'draft'} proposals)")
    assert p_value > ALPHA


def test_the_chi_square_check_has_power():
    """Taking drafts without verification is caught: that is what the test guards against."""
    counts = first_tokens(P_LOGITS, Q, n_gram=False, accept_all=True)
    assert goodness_of_fit(counts, P_LOGITS[0].softmax(-1).double()) < 1e-12


def test_a_draft_far_less_likely_under_the_target_can_still_be_accepted(monkeypatch):
    """p/q of 1e-9, below any 23-bit uniform (at least 2**-24): accepted when the uniform is below it, as the rule
    says, because the test uses 52-bit uniforms and compares in float64."""
    from common.engine import spec_verify
    logits = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    logits[0, 1] = math.log(1e-9 * 2 / (1 - 1e-9))  # p(1) = 1e-9 at the first row, under a draft q(1) = 1
    params = SamplingParams(temperature=1.0)
    for u, accepted in ((1e-12, 1), (1e-6, 0)):
        monkeypatch.setattr(spec_verify, "counter_uniform64",
                            lambda seeds, steps, column, u=u: torch.full((len(seeds),), u, dtype=torch.float64))
        out = verify_drafts(logits, [Sequence("r", [1, 2], params, seed=5)], [[1]], [None])
        assert out.num_accepted == [accepted]


# The bigram models' vocabulary: the engine's cost here is the head and the sampler's passes over [rows, vocab], and
# the joint distributions under test live on a few tokens of it (top_k=4).
BIGRAM_VOCAB = 2048


def bigram_model(directory, source, seed, noise=0.0):
    """A tiny Llama whose layers add nothing (o_proj, down_proj zeroed): its next-token
    distribution depends on the last token only, so lookups can predict it. With ``noise``,
    the same model with a perturbed output head: a draft close to, but not equal to, the target."""
    build_tiny_model("llama", directory, seed=seed, tokenizer_from=source, vocab_size=BIGRAM_VOCAB)
    path = directory / "model.safetensors"
    tensors = load_file(path)
    for name in tensors:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensors[name].zero_()
    tensors["lm_head.weight"] *= 40.0  # sharpen: a few likely successors per token
    if noise:
        gen = torch.Generator().manual_seed(seed + 1)
        head = tensors["lm_head.weight"]
        head += noise * head.std() * torch.randn(head.shape, generator=gen)
    save_file(tensors, path, metadata={"format": "pt"})
    return directory


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory, embedded_model_dir):
    target = bigram_model(tmp_path_factory.mktemp("t"), embedded_model_dir, seed=11)
    draft = bigram_model(tmp_path_factory.mktemp("d"), embedded_model_dir, seed=11, noise=0.5)
    return target, draft


MAX_TOKENS = 4


def sample_joint(model_dir, prompt, num_samples, first_seed=0, spec=None):
    """Joint distribution of the generated tokens, top_k=4 keeping the support small; ``spec``: engine.spec."""
    engine = LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=2048, max_num_seqs=200,
                                    max_num_batched_tokens=4096, spec={"max_batch_size": 200, **(spec or {})}))
    params = [SamplingParams(temperature=0.8, top_k=4, max_tokens=MAX_TOKENS, ignore_eos=True, seed=s)
              for s in range(first_seed, first_seed + num_samples)]
    outs = engine.generate([prompt] * num_samples, params)
    assert engine.block_manager.num_used_blocks == 0
    return collections.Counter(tuple(o.outputs[0].token_ids) for o in outs), engine.stats


@pytest.fixture(scope="module")
def echo_prompt(tiny_pair):
    """The target's greedy chain from token 17, then 17 again: generation starts where the
    chain did, so lookups propose each token's likeliest successor."""
    engine = LLMEngine(EngineConfig(model=str(tiny_pair[0]), num_kv_blocks=64))
    (out,) = engine.generate([[17]], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    return [17] + out.outputs[0].token_ids + [17]


SAMPLES = 3000


@pytest.fixture(scope="module")
def plain_joint(tiny_pair, echo_prompt):
    """The plain engine's joint distribution, which each method's is compared with."""
    return sample_joint(tiny_pair[0], echo_prompt, SAMPLES)[0]


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_engine_distribution_with_speculation_equals_plain(method, tiny_pair, echo_prompt, plain_joint):
    target, draft = tiny_pair
    extra = {"method": "ngram", "ngram_min": 1} if method == "ngram" else {"method": "draft", "draft_model": str(draft)}
    # Other seeds: the counter RNG couples runs with equal seeds, and the test needs independent samples.
    spec, stats = sample_joint(target, echo_prompt, SAMPLES, first_seed=10**6,
                               spec={"adaptive": False, "num_tokens": 2, **extra})
    assert stats.num_spec_drafts > SAMPLES // 4, "speculation barely ran; the test would prove nothing"
    assert 0 < stats.num_spec_accepted_tokens < stats.num_spec_draft_tokens, "need both accepts and rejects"
    p_value = homogeneity(plain_joint, spec)
    print(f"{method}: {len(plain_joint)} outcomes, acceptance "
          f"{stats.num_spec_accepted_tokens / stats.num_spec_draft_tokens:.2f}, homogeneity p = {p_value:.3g}")
    assert p_value > ALPHA
