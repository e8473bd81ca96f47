"""A choice's way to its first tokens in contiguous parts: where its time to first token (TTFT) went and, for a
disaggregated choice, where the handoff to its decode worker went. Marks on the proxy's clock, as the choice's
handler (``proxy.core.requests.SubRequest``) sees the messages:

    arrival --queue--> dispatched --prefill--> first token                        TTFT = queue + prefill
    first token (PrefillDone) --decode_wait--> DecodeRequest sent --transfer--> KVPulled
        --first_decode--> first token from the decode worker                      handoff (disaggregated only)

- queue: arrival to the first message to a worker: the admission and fairness queues, the prefill gate, a cold
  model's load; for a choice prefilled on its decode worker (local), the wait for its decode slot too.
- prefill: that message to the first token: PrefillRequest sent to PrefillDone received; for a local choice,
  DecodeRequest sent to its first token (the decode worker's prompt step).
- decode_wait: PrefillDone to the DecodeRequest: the wait for a decode slot.
- transfer: DecodeRequest sent to KVPulled received, with the bytes and the backend the decode worker reports. For a
  pipelined hand-off (``kv_pipeline.min_tokens``) the DecodeRequest after PrefillDone: the part of the pull left
  once the prompt was computed (the layer groups pulled meanwhile are in the prefill part's time).
- first_decode: KVPulled to the first TokenDelta that carries a token.

A disaggregated choice's first token is PrefillDone's, streamed at once: the transfer and the first decode step
delay its second token, not its first; they are the handoff's parts, not the TTFT's.

A choice is split once, on one attempt. One that resumed or was preempted (``restarted``) before its first token
has no TTFT parts: its TTFT spans an attempt that no part would name. One that did so, or whose pull failed (the
decode worker recomputed the prompt), before its decode worker's first token has no handoff parts. Each part is a
difference of two marks, so a split choice's parts add up to its TTFT, and to its handoff, exactly.
"""
from __future__ import annotations

TTFT_PARTS = ("queue", "prefill")
HANDOFF_PARTS = ("decode_wait", "transfer", "first_decode")


class FirstTokenParts:
    """The marks of one choice's first attempt, up to its first token and its decode worker's first token."""
    __slots__ = ("arrival", "dispatched", "prefill_worker", "local", "prefill_done", "decode_sent", "decode_worker",
                 "kv_pulled", "kv_bytes", "kv_backend", "kv_failed", "first_token", "first_decoded", "void",
                 "awaiting_decode")

    def __init__(self, arrival: float) -> None:
        self.arrival = arrival
        self.dispatched: float | None = None  # the first message to a worker
        self.prefill_worker = ""  # the worker that computed the prompt (the decode worker, when local)
        self.local = False
        self.prefill_done: float | None = None
        self.decode_sent: float | None = None
        self.decode_worker = ""
        self.kv_pulled: float | None = None
        self.kv_bytes = 0
        self.kv_backend = ""
        self.kv_failed = False
        self.first_token: float | None = None
        self.first_decoded: float | None = None
        self.void = False  # the attempt these marks belong to was given up: no more marks
        # Disaggregated, on its first attempt, and no token from its decode worker yet: a plain attribute, as the
        # proxy asks at every token delta.
        self.awaiting_decode = False

    def dispatch(self, worker_id: str, now: float, local: bool) -> None:
        """The prompt went to ``worker_id``: a prefill worker, or (``local``) the decode worker that prefills it."""
        if self.void or self.dispatched is not None:
            return
        self.dispatched, self.prefill_worker, self.local = now, worker_id, local
        if local:
            self.decode_sent, self.decode_worker = now, worker_id

    def prefilled(self, now: float) -> None:
        """PrefillDone came: the first token, from a prefill worker."""
        if not self.void and self.prefill_done is None:
            self.prefill_done = now
            self.awaiting_decode = True

    def handed_off(self, worker_id: str, now: float) -> None:
        """The DecodeRequest naming the prefilled pages went to ``worker_id``."""
        if not self.void and self.prefill_done is not None and self.decode_sent is None:
            self.decode_sent, self.decode_worker = now, worker_id

    def pulled(self, ok: bool, num_bytes: int, backend: str, now: float) -> None:
        """KVPulled came: the pages are on the decode worker (``ok``), or it recomputes the prompt."""
        if self.void or self.decode_sent is None or self.kv_pulled is not None or self.first_decoded is not None:
            return
        self.kv_pulled, self.kv_bytes, self.kv_backend, self.kv_failed = now, num_bytes, backend, not ok

    def first(self, now: float) -> dict[str, float] | None:
        """The choice's first token reached the proxy: its TTFT parts, None when it is not split."""
        if self.void or self.first_token is not None:
            return None
        self.first_token = now
        if self.local:
            self.first_decoded = now
        return self.ttft()

    def decoded(self, now: float) -> dict[str, float] | None:
        """The decode worker's first token reached the proxy: the handoff's parts, None when it is not split."""
        if not self.awaiting_decode:
            return None
        self.first_decoded, self.awaiting_decode = now, False
        return self.handoff()

    def restarted(self) -> None:
        """The attempt is given up (resumed elsewhere, preempted): what it had not reached stays unsplit."""
        self.void, self.awaiting_decode = True, False

    def ttft(self) -> dict[str, float] | None:
        """queue and prefill, which add up to the TTFT; None before the first token or when not split."""
        if self.first_token is None or self.dispatched is None:
            return None
        return {"queue": self.dispatched - self.arrival, "prefill": self.first_token - self.dispatched}

    def handoff(self) -> dict[str, float] | None:
        """decode_wait, transfer and first_decode, which add up to the gap from PrefillDone to the decode worker's
        first token; None for a local choice, a failed pull, or a handoff not (or not yet) complete."""
        if (self.local or self.kv_failed or self.first_decoded is None or self.kv_pulled is None
                or self.decode_sent is None or self.prefill_done is None):
            return None
        return {"decode_wait": self.decode_sent - self.prefill_done, "transfer": self.kv_pulled - self.decode_sent,
                "first_decode": self.first_decoded - self.kv_pulled}

    def describe(self) -> str:
        """The parts as ``key=value`` pairs for a request's end line, in milliseconds; what is missing is left out,
        and ``split=no`` says the TTFT was not split."""
        fields = []
        if (ttft := self.ttft()) is not None:
            fields += [f"{part}_ms={ttft[part] * 1e3:.2f}" for part in TTFT_PARTS]
            fields += [f"prefill_worker={self.prefill_worker}", f"local={'yes' if self.local else 'no'}"]
        else:
            fields.append("split=no")
        if self.kv_pulled is not None:
            fields += [f"kv_bytes={self.kv_bytes}", f"kv_backend={self.kv_backend or '-'}",
                       f"kv_pull={'failed' if self.kv_failed else 'ok'}"]
        if (handoff := self.handoff()) is not None:
            fields += [f"{part}_ms={handoff[part] * 1e3:.2f}" for part in HANDOFF_PARTS]
            fields.append(f"decode_worker={self.decode_worker}")
        return " ".join(fields)
