"""Verifying draft tokens against the target model: lossless speculative sampling.

A sequence that proposed k drafts ``d_1..d_k`` ran k + 1 rows through the
target: row i scores the token after ``d_i`` (row 0 after the last known
token). Row i's target distribution ``p_i`` is the one plain sampling would
use at that position (penalties with the drafts before it counted as
output, then temperature, min_p, top_k, top_p), so:

- greedy rows accept the longest run of drafts equal to the target's argmax,
  then emit the argmax after it (the correction, or the bonus when all k
  matched);
- sampled rows use the standard rule (Leviathan et al., 2023; Chen et al.,
  2023): accept ``d_i`` when ``u <= p_i(d_i) / q_i(d_i)``; at the first
  rejection draw from ``norm(max(0, p_i - q_i))``; when all pass, draw the
  bonus token from ``p_k``. Deterministic proposals (n-gram lookups) have
  ``q_i`` one-hot at ``d_i``. The emitted tokens are then distributed
  exactly as plain sampling's.

All uniforms come from the counter RNG keyed by (seed, generation index):
the acceptance test reads column ``vocab``, and the draws read a token's
column (its id, below ``vocab``) and a block's (``vocab + 1`` on: the
sampler's two-round race), so the two are independent, and a redraw never
reuses a uniform that decided an earlier emitted token.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from common.engine.counter_rng import as_int64, counter_uniform64
from common.engine.sampler import SamplingRow, draw, penalty_prompt_ids, processed_probs, token_logprobs
from common.engine.sequence import Sequence


@dataclass
class Verified:
    """Per verifying sequence: the tokens it emits and how many drafts it accepted."""

    token_ids: list[list[int]]
    num_accepted: list[int]
    logprobs: list[list[float]] | None = None
    top_logprobs: list[list[list[tuple[int, float]]]] | None = None


def verify_drafts(
    logits: torch.Tensor, seqs: list[Sequence], drafts: list[list[int]], draft_probs: list[torch.Tensor | None]
) -> Verified:
    """``logits`` holds len(drafts[s]) + 1 consecutive rows per sequence, in order."""
    counts = [len(d) + 1 for d in drafts]
    if sum(counts) != logits.shape[0]:
        raise ValueError(f"{logits.shape[0]} logit rows for {sum(counts)} verification rows")
    starts = [total - count for total, count in zip(itertools.accumulate(counts), counts)]
    if all(_plain_greedy(seq) for seq in seqs):
        targets = logits.argmax(-1).tolist()
        accepted = _accepted_greedy(targets, drafts, starts)
        emitted = [d[:a] + [targets[start + a]] for d, a, start in zip(drafts, accepted, starts)]
        return Verified(emitted, accepted)

    rows = _rows(seqs, drafts)
    probs = processed_probs(logits, rows)
    accepted, final = _accept_sampled(probs, rows, drafts, draft_probs, starts)
    emitted = [d[:a] + [t] for d, a, t in zip(drafts, accepted, final)]
    out = Verified(emitted, accepted)
    if any(seq.params.logprobs is not None for seq in seqs):
        _attach_logprobs(out, logits, rows, counts, starts)
    return out


def _plain_greedy(seq: Sequence) -> bool:
    p = seq.params
    return p.greedy and not p.needs_penalties and p.logprobs is None


def _accepted_greedy(targets: list[int], drafts: list[list[int]], starts: list[int]) -> list[int]:
    accepted = []
    for d, start in zip(drafts, starts):
        a = 0
        while a < len(d) and d[a] == targets[start + a]:
            a += 1
        accepted.append(a)
    return accepted


def _rows(seqs: list[Sequence], drafts: list[list[int]]) -> list[SamplingRow]:
    """One sampling row per verification row; drafts before it count as output."""
    rows = []
    for seq, d in zip(seqs, drafts):
        generated, prompt = seq.num_output_tokens, penalty_prompt_ids(seq)
        # the output's copies only where the penalties read them, not k + 1 copies of every output each step
        output = seq.output_token_ids if seq.params.needs_penalties else None
        for i in range(len(d) + 1):
            rows.append(SamplingRow(seq.params, prompt, () if output is None else output + d[:i], seq.seed,
                                    generated + i))
    return rows


def _accept_sampled(
    probs: torch.Tensor,
    rows: list[SamplingRow],
    drafts: list[list[int]],
    draft_probs: list[torch.Tensor | None],
    starts: list[int],
) -> tuple[list[int], list[int]]:
    device, vocab = probs.device, probs.shape[1]
    seeds = torch.tensor([as_int64(r.seed) for r in rows], device=device)
    steps = torch.tensor([r.generation_index for r in rows], device=device)
    # Row r's draft (the bonus row of each sequence holds a placeholder 0).
    row_drafts = torch.tensor([t for d in drafts for t in (*d, 0)], device=device)
    p_draft = probs.gather(1, row_drafts[:, None]).squeeze(1)
    q_draft = torch.ones_like(p_draft)
    for d, q, start in zip(drafts, draft_probs, starts):
        if q is not None and d:
            q_draft[start:start + len(d)] = q[: len(d)].gather(1, torch.tensor(d, device=device)[:, None]).squeeze(1)
    # 52-bit uniforms, compared in float64: a 23-bit u (at least 2**-24) would never accept a draft whose p/q is
    # below that
    uniforms = counter_uniform64(seeds, steps, vocab)
    passes = (uniforms * q_draft.double() <= p_draft.double()).tolist()

    accepted, final_rows = [], []
    for d, start in zip(drafts, starts):
        a = 0
        while a < len(d) and passes[start + a]:
            a += 1
        accepted.append(a)
        final_rows.append(start + a)

    final = probs[final_rows].clone()
    for s, (d, q, a) in enumerate(zip(drafts, draft_probs, accepted)):
        if a == len(d):
            continue  # bonus: sample p itself
        residual = final[s] - (q[a] if q is not None else _one_hot(d[a], vocab, device))
        residual.clamp_(min=0)
        if residual.sum() > 0:
            final[s] = residual
        # else p == q there, where the draft is always accepted; keep p.
    tokens = draw(final, seeds[final_rows], steps[final_rows])
    return accepted, tokens.tolist()


def _one_hot(token: int, vocab: int, device) -> torch.Tensor:
    out = torch.zeros(vocab, device=device)
    out[token] = 1.0
    return out


def _attach_logprobs(
    out: Verified, logits: torch.Tensor, rows: list[SamplingRow], counts: list[int], starts: list[int]
) -> None:
    """Logprobs of each emitted token at its own row, from the raw logits (as plain sampling)."""
    row_tokens = []
    for emitted, count in zip(out.token_ids, counts):
        row_tokens.extend(emitted + [0] * (count - len(emitted)))
    chosen, top = token_logprobs(logits, rows, torch.tensor(row_tokens, device=logits.device))
    if chosen is None:
        return
    out.logprobs, out.top_logprobs = [], []
    for emitted, start in zip(out.token_ids, starts):
        out.logprobs.append(chosen[start:start + len(emitted)])
        out.top_logprobs.append(top[start:start + len(emitted)])
