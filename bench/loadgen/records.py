"""One request as the client saw it, and the per-request metrics derived from it.

Times are seconds on the client's monotonic clock, relative to the start of
the load point. A record is filled by the client while its stream is read:

    scheduled_s (arrival) -> sent_s (after any concurrency wait)
    -> chunk_times_s (each chunk that carried generated text) -> end_s (stream closed after [DONE])

and fails at most once: the first failure's kind and message stay. The
definitions follow the field (vLLM's ``bench serve``):

- TTFT: first content chunk - send. A chat stream's opening role chunk carries
  no text and does not count.
- E2E latency: end of the stream - send.
- TPOT: (E2E - TTFT) / (output tokens - 1); undefined for a one-token output.
- ITL: the gaps between consecutive content chunks.

Output tokens come from the stream's final ``usage`` when the server sends
one (``stream_options.include_usage``), else one token per content chunk.
A server that packs several tokens into one chunk (or holds back the text of
an incomplete character) then shows fewer, longer ITL gaps than tokens; TTFT,
TPOT and E2E stay exact whenever ``usage`` is present.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestRecord:
    index: int
    tenant: str
    input_len: int | None  # the workload's count; the server's usage.prompt_tokens replaces it
    expected_output_len: int
    scheduled_s: float = 0.0
    sent_s: float | None = None
    chunk_times_s: list[float] = field(default_factory=list)
    end_s: float | None = None
    usage_prompt_tokens: int | None = None
    usage_completion_tokens: int | None = None
    error_kind: str | None = None
    error: str = ""
    output_text: str = ""  # the generated text, as streamed

    def fail(self, kind: str, message: str) -> None:
        if self.error_kind is None:
            self.error_kind, self.error = kind, message[:500]

    @property
    def ok(self) -> bool:
        return self.error_kind is None and self.end_s is not None and bool(self.chunk_times_s)

    @property
    def input_tokens(self) -> int:
        if self.usage_prompt_tokens is not None:
            return self.usage_prompt_tokens
        return self.input_len or 0

    @property
    def output_tokens(self) -> int:
        if self.usage_completion_tokens is not None:
            return self.usage_completion_tokens
        return len(self.chunk_times_s)

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_times_s[0] - self.sent_s if self.ok else None

    @property
    def e2e_s(self) -> float | None:
        return self.end_s - self.sent_s if self.ok else None

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    @property
    def itls_s(self) -> list[float]:
        if not self.ok:
            return []
        times = self.chunk_times_s
        return [later - earlier for earlier, later in zip(times, times[1:])]

    @property
    def queue_s(self) -> float | None:
        """Time spent waiting for a concurrency slot at the client before being sent."""
        return None if self.sent_s is None else self.sent_s - self.scheduled_s
