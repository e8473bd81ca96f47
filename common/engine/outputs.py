"""What the engine returns per request, and the output processor that builds it.

The processor turns newly appended tokens into text deltas (incremental
detokenization that never splits a UTF-8 character), applies stop strings
(which may span tokens and are held back until resolved), and reports each
touched request once per step.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from common.engine.sequence import FinishReason, Sequence
from common.text.tokenizer import TextState, Tokenizer


@dataclass
class CompletionOutput:
    index: int
    text: str  # all text so far
    text_delta: str  # text added since the previous report
    token_ids: list[int]
    token_ids_delta: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache

    @property
    def finished(self) -> bool:
        return all(o.finished for o in self.outputs)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def start(self, seq: Sequence) -> None:
        seq.text_state = TextState(self.tokenizer, seq.prompt_token_ids, seq.params)

    def process(self, seqs: list[Sequence], finish) -> None:
        """Detokenize new tokens of ``seqs``; ``finish(seq, reason, stop)`` ends a stop-string hit."""
        for seq in seqs:
            state: TextState = seq.text_state
            new = seq.token_ids[seq.num_prompt_tokens + state.num_tokens:]
            _, stop = state.update(new)
            if stop is not None:
                finish(seq, FinishReason.STOP, stop)

    def report(self, request_id: str, seqs: list[Sequence]) -> RequestOutput:
        out = RequestOutput(request_id, seqs[0].prompt_token_ids, num_cached_tokens=seqs[0].num_prefix_cached_tokens)
        for seq in seqs:
            state: TextState = seq.text_state
            # A handed-off sequence continues on a decode worker, which replays
            # its first token: text held back for a possible stop string stays held.
            if seq.is_finished and not state.flushed and seq.finish_reason is not FinishReason.HANDOFF:
                state.flush()
            tokens = seq.output_token_ids[: state.num_tokens]
            new_tokens = tokens[seq.reported_tokens:]
            wants_logprobs = seq.params.logprobs is not None
            out.outputs.append(CompletionOutput(
                index=seq.index,
                text=state.text,
                text_delta=state.take_delta(),
                token_ids=tokens,
                token_ids_delta=new_tokens,
                logprobs=seq.logprobs[: len(tokens)] if wants_logprobs else None,
                top_logprobs=seq.top_logprobs[: len(tokens)] if wants_logprobs else None,
                finish_reason=seq.finish_reason.value if seq.finish_reason else None,
                stop_reason=seq.stop_reason,
            ))
            seq.reported_tokens = len(tokens)
        return out
