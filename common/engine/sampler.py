"""Batched token sampling: logits [B, V] plus per-row parameters -> next tokens.

Pipeline, vectorized over the batch (Python only gathers per-row settings and
token ids):

    raw logits --log_softmax--> logprobs (chosen token + top alternatives)
    raw logits -> penalties -> greedy rows: argmax
                            -> other rows: / temperature -> min_p -> top_k
                                  -> top_p -> softmax -> draw: argmax(mass / E) over blocks of
                                     tokens, then argmax(probs / E) in the block, E = -log(u), u
                                     from the counter RNG

``processed_probs`` and ``draw`` are separate so that speculative decoding can
score draft tokens against the same target distribution and redraw with the
same reproducible uniforms.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from common.engine.counter_rng import as_int64, counter_uniforms
from common.protocol.sampling_params import SamplingParams

# top_p looks for the nucleus among the highest logits, widening through these
# counts before it resorts to the whole vocab: on CPU a top-k of 256 (4096)
# costs ~1/30 (~1/7) of a 49k-vocab sort, and real LM distributions put
# top_p's mass in a few hundred tokens at most.
_TOP_P_CANDIDATES = (256, 4096)
# On CPU, [rows, vocab] temporaries of a few hundred rows miss every cache and
# page-fault on each allocation; chunks of about this many elements run 2-3x
# faster there. A GPU takes all rows at once.
_CPU_CHUNK_ELEMENTS = 2**20
# ``draw``'s first round races blocks of this many tokens by their mass, its second the winning block's tokens.
_DRAW_BLOCK = 256
LOGPROB_FLOOR = -9999.0


@dataclass
class SamplingRow:
    params: SamplingParams
    # read only by the repetition penalty; its distinct ids as a tensor will do (``penalty_prompt_ids``)
    prompt_token_ids: Sequence[int] | torch.Tensor
    output_token_ids: Sequence[int]  # generated before this step; read only by the penalties
    seed: int  # effective seed; the engine draws one for unseeded requests
    num_generated: int = -1  # tokens generated before this step; -1: len(output_token_ids)

    @property
    def generation_index(self) -> int:
        return self.num_generated if self.num_generated >= 0 else len(self.output_token_ids)


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # Per row; None when no row asked for logprobs. Rows that did not ask hold
    # NaN and an empty list.
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Repetition (prompt + output tokens) then frequency/presence (output only).

    Returns ``logits`` itself when no row has penalties, else a new tensor. Only the tokens a row has seen are
    read and written (keys row * vocab + id): the cost follows the rows' token counts, not rows x vocabulary, and
    each logit gets the same float32 operations, in the same order, as a dense pass over the whole rows would.
    """
    index = [i for i, row in enumerate(rows) if row.params.needs_penalties]
    if not index:
        return logits
    params = [rows[i].params for i in index]
    sub = logits[index]
    vocab, device = sub.shape[1], logits.device
    flat = sub.view(-1)

    def column(name: str) -> torch.Tensor:
        return torch.tensor([getattr(p, name) for p in params], device=device)

    output_keys, output_counts = _token_keys([rows[i].output_token_ids for i in index], vocab, device)
    if any(p.repetition_penalty != 1.0 for p in params):
        prompt_keys, _ = _token_keys([rows[i].prompt_token_ids for i in index], vocab, device)
        seen = torch.unique(torch.cat([prompt_keys, output_keys]))
        repetition = column("repetition_penalty")[seen // vocab]
        values = flat[seen]
        # HF/vLLM: shrink a seen token's logit towards zero on either side.
        flat[seen] = torch.where(values > 0, values / repetition, values * repetition)
    row_of = output_keys // vocab
    values = flat[output_keys] - column("frequency_penalty")[row_of] * output_counts
    flat[output_keys] = values - column("presence_penalty")[row_of]
    return logits.index_copy(0, torch.tensor(index, device=device), sub)


def penalty_prompt_ids(seq) -> Sequence[int] | torch.Tensor:
    """What a sequence's rows pass as ``prompt_token_ids``: its prompt's distinct ids (a tensor, made on its first
    step with a repetition penalty and kept on it, ``Sequence.distinct_prompt_ids``), or nothing when no penalty
    reads the prompt."""
    if seq.params.repetition_penalty == 1.0:
        return ()
    if seq.distinct_prompt_ids is None:
        seq.distinct_prompt_ids = torch.unique(torch.tensor(seq.prompt_token_ids, dtype=torch.long))
    return seq.distinct_prompt_ids


def _token_keys(id_lists: list[Sequence[int] | torch.Tensor], vocab: int,
                device) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's distinct ids as sorted keys row * vocab + id, and how often each occurs (float32)."""
    ids = [torch.as_tensor(row_ids, dtype=torch.long) for row_ids in id_lists]
    flat = torch.cat(ids) if ids else torch.empty(0, dtype=torch.long)
    # a key row * vocab + id past the row's vocabulary would be another row's token
    bad = flat[(flat < 0) | (flat >= vocab)]
    if len(bad):
        raise ValueError(f"token id {int(bad[0])} outside the logits' vocab of {vocab}")
    row_of = torch.repeat_interleave(torch.arange(len(ids)), torch.tensor([len(x) for x in ids], dtype=torch.long))
    keys, counts = torch.unique(row_of * vocab + flat, return_counts=True)
    return keys.to(device), counts.to(device=device, dtype=torch.float32)


def processed_probs(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The distribution each row samples from, [B, V] float32.

    Greedy rows get a one-hot of the argmax of their penalized logits, which is
    also what speculative decoding must accept drafts against.
    """
    logits = apply_penalties(logits.float(), rows)
    greedy = [i for i, row in enumerate(rows) if row.params.greedy]
    if not greedy:
        return _filtered_softmax(logits, [row.params for row in rows])
    probs = torch.zeros_like(logits)
    probs[greedy] = probs[greedy].scatter_(1, logits[greedy].argmax(-1, keepdim=True), 1.0)
    stochastic = [i for i, row in enumerate(rows) if not row.params.greedy]
    if stochastic:
        probs[stochastic] = _filtered_softmax(logits[stochastic], [rows[i].params for i in stochastic])
    return probs


def _filtered_softmax(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, then min_p, top_k and top_p as -inf masks, then softmax.

    Each filter sees the survivors of the previous one, so top_p's mass is
    renormalized. Only the rows that use a filter pay for it: the filters'
    top-k calls are the sampler's largest cost.
    """
    device = logits.device
    logits = logits / torch.tensor([p.temperature for p in params], device=device)[:, None]
    filters = (  # (setting, whether a row uses it, its per-row logit floor)
        ("min_p", lambda value: value > 0.0, _min_p_floor),
        ("top_k", lambda value: value > 0, _top_k_floor),
        ("top_p", lambda value: value < 1.0, _nucleus_floor),
    )
    for name, used, floor_of in filters:
        index = [i for i, p in enumerate(params) if used(getattr(p, name))]
        if not index:
            continue
        setting = torch.tensor([getattr(params[i], name) for i in index], device=device)
        # Every row: mask in place rather than copy the batch out and back.
        sub = logits if len(index) == len(params) else logits[index]
        sub.masked_fill_(sub < floor_of(sub, setting), -math.inf)
        if sub is not logits:
            logits[index] = sub
    return logits.softmax(-1)


def _min_p_floor(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    # p >= min_p * p_max  <=>  logit >= max_logit + log(min_p): no softmax needed.
    return logits.amax(-1, keepdim=True) + min_p.log()[:, None]


def _top_k_floor(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    # Ties with the k-th logit survive too, as in vLLM.
    top_k = top_k.clamp(max=logits.shape[1])
    return logits.topk(int(top_k.max())).values.gather(1, top_k[:, None] - 1)


def _nucleus_floor(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per-row logit threshold of the smallest set whose mass reaches top_p."""
    vocab = logits.shape[1]
    floor = torch.empty(len(logits), 1, dtype=logits.dtype, device=logits.device)
    pending = torch.arange(len(logits), device=logits.device)
    for k in (*_TOP_P_CANDIDATES, vocab):
        row_floor, settled = _nucleus_floor_within(logits[pending], top_p[pending], min(k, vocab))
        floor[pending[settled]] = row_floor[settled]
        pending = pending[~settled]
        if len(pending) == 0:
            break
    return floor


def _nucleus_floor_within(
    logits: torch.Tensor, top_p: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Threshold from the k highest logits, and whether that settles the row.

    It does when those k hold top_p's mass, or when they are the whole vocab.
    """
    values = logits.topk(k).values  # sorted descending
    probs = (values - logits.logsumexp(-1, keepdim=True)).exp()
    cumulative = probs.cumsum(-1)
    # A token is in the nucleus when the mass ranked strictly before it is
    # still short of top_p; the first token always is.
    kept = ((cumulative - probs) < top_p[:, None]).sum(-1, keepdim=True).clamp(min=1)
    settled = (cumulative[:, -1] >= top_p) | (k == logits.shape[1])
    return values.gather(1, kept - 1), settled


def draw(probs: torch.Tensor, seeds: torch.Tensor, generation_indices: torch.Tensor) -> torch.Tensor:
    """An exponential race in two rounds: first among blocks of ``_DRAW_BLOCK`` tokens, by their mass, then among
    the winning block's tokens. Each round is the race argmax_i w_i / E_i with E_i = -log(u_i), which picks i with
    probability w_i / sum(w): a block with its mass's share, then a token with its share of that mass, so a token
    with its probability. u is a pure function of (seed, generation index, column): a token's column is its id, a
    block's comes after the vocabulary and speculative decoding's acceptance column (vocab + 1 + block). So a row
    draws the same token whatever its batch neighbours or position (on CPU, where each block's sum runs in one order
    whatever the batch; a GPU's reduction may split a sum by the batch's shape, so a near-tie of two blocks could go
    either way there), and hashes a block's worth of columns and one per block instead of one per token (at 128,256
    tokens, 757 instead of 128,256). A near-tie in either round is all that float noise in the logits can flip, as
    in a one-round race.
    """
    rows, vocab = probs.shape
    seeds, generation_indices = seeds.to(probs.device), generation_indices.to(probs.device)
    whole = vocab // _DRAW_BLOCK
    probs = probs.contiguous()
    masses = probs.as_strided((rows, whole, _DRAW_BLOCK), (vocab, _DRAW_BLOCK, 1)).sum(-1)
    if whole * _DRAW_BLOCK != vocab:  # the last block: the tokens past the whole ones
        masses = torch.cat([masses, probs[:, whole * _DRAW_BLOCK:].sum(-1, keepdim=True)], dim=1)
    blocks = masses.shape[1]
    block_columns = torch.arange(vocab + 1, vocab + 1 + blocks, device=probs.device)
    block_exponentials = counter_uniforms(seeds, generation_indices, block_columns).log_().neg_()
    block = (masses / block_exponentials).argmax(-1)
    columns = block[:, None] * _DRAW_BLOCK + torch.arange(_DRAW_BLOCK, device=probs.device)
    outside = columns >= vocab  # the last block's columns past the vocabulary: no mass, never drawn
    weights = probs.gather(1, columns.clamp(max=vocab - 1)).masked_fill_(outside, 0.0)
    exponentials = counter_uniforms(seeds, generation_indices, columns).log_().neg_()
    return columns.gather(1, (weights / exponentials).argmax(-1, keepdim=True)).squeeze(1)


class Sampler:
    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        if len(rows) != logits.shape[0]:
            raise ValueError(f"{logits.shape[0]} logit rows but {len(rows)} sampling rows")
        if all(argmax_suffices(r.params) for r in rows):
            return SamplerOutput(logits.argmax(-1).tolist(), None, None)

        token_ids = torch.empty(len(rows), dtype=torch.long, device=logits.device)
        greedy = [i for i, r in enumerate(rows) if r.params.greedy]
        if greedy:
            penalized = apply_penalties(logits[greedy].float(), [rows[i] for i in greedy])
            token_ids[greedy] = penalized.argmax(-1)
        stochastic = [i for i, r in enumerate(rows) if not r.params.greedy]
        for chunk in _row_chunks(stochastic, logits):
            picked = [rows[i] for i in chunk]
            seeds = torch.tensor([as_int64(r.seed) for r in picked], device=logits.device)
            steps = torch.tensor([r.generation_index for r in picked], device=logits.device)
            token_ids[chunk] = draw(processed_probs(logits[chunk], picked), seeds, steps)

        logprobs, top_logprobs = token_logprobs(logits, rows, token_ids)
        return SamplerOutput(token_ids.tolist(), logprobs, top_logprobs)


def _row_chunks(index: list[int], logits: torch.Tensor) -> list[list[int]]:
    on_cpu = logits.device.type == "cpu"
    size = max(1, _CPU_CHUNK_ELEMENTS // logits.shape[1]) if on_cpu else max(1, len(index))
    return [index[start:start + size] for start in range(0, len(index), size)]


def argmax_suffices(params: SamplingParams) -> bool:
    """Whether a row's token is its logits' argmax and nothing else reads them (the model runner's greedy head)."""
    return params.greedy and not params.needs_penalties and params.logprobs is None


def token_logprobs(
    raw_logits: torch.Tensor, rows: list[SamplingRow], token_ids: torch.Tensor
) -> tuple[list[float] | None, list[list[tuple[int, float]]] | None]:
    """Chosen-token logprob and top-k alternatives from the raw logits, as vLLM."""
    asking = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    if not asking:
        return None, None
    # Floored as vLLM does: a token structured output masked has -inf, which JSON cannot carry.
    logprobs = raw_logits[asking].float().log_softmax(-1).clamp_(min=LOGPROB_FLOOR)
    chosen = logprobs.gather(1, token_ids[asking][:, None]).squeeze(1).tolist()
    widest = max(rows[i].params.logprobs for i in asking)
    top_values, top_ids = (x.tolist() for x in logprobs.topk(widest))

    per_row: list[float] = [math.nan] * len(rows)
    alternatives: list[list[tuple[int, float]]] = [[] for _ in rows]
    for j, i in enumerate(asking):
        per_row[i] = chosen[j]
        k = rows[i].params.logprobs
        alternatives[i] = list(zip(top_ids[j][:k], top_values[j][:k]))
    return per_row, alternatives
