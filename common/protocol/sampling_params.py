"""Per-request sampling parameters: one typed struct from the HTTP edge to the sampler.

``SamplingParams`` is a msgspec Struct, so it travels on the wire as itself
(``PrefillRequest.params``, ``DecodeRequest.params``) and the wire decoder
checks each field's type and bounds on arrival; what bounds cannot say is
checked in ``__post_init__``, which runs both when the proxy builds one and
when a worker decodes one. Every error names the field.
"""
from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from common.protocol.names import SPEC_METHODS, SpecMethod

MAX_LOGPROBS = 20
MAX_SPECULATIVE_TOKENS = 16
INT64_MAX = (1 << 63) - 1
TOKEN_ID_MAX = (1 << 31) - 1  # no vocabulary comes near; bounds ids before they index a tensor

NonNegInt = Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)]
TokenId = Annotated[int, msgspec.Meta(ge=0, le=TOKEN_ID_MAX)]
Penalty = Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)]


StructuredKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]
STRUCTURED_KINDS: tuple[str, ...] = StructuredKind.__args__


class StructuredOutput(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """A constraint on the output: each sampled token keeps the text a prefix of one the constraint accepts.

    ``spec`` is the JSON schema's text (``json_schema``), the regular expression (``regex``) or the EBNF grammar
    (``grammar``); ``choices`` the strings of ``choice``; ``json_object`` needs neither. Compiled by the workers
    (``common.engine.structured_output``), which refuse what does not compile, naming why.
    """
    kind: StructuredKind
    spec: str = ""
    choices: list[str] = msgspec.field(default_factory=list)

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(f"structured output kind must be one of {', '.join(STRUCTURED_KINDS)} "
                             f"(got {self.kind!r})")
        if self.kind in ("json_schema", "regex", "grammar") and not self.spec:
            raise ValueError(f"a {self.kind} constraint needs its spec")
        if self.kind == "choice" and (not self.choices or not all(isinstance(c, str) and c for c in self.choices)):
            raise ValueError("a choice constraint needs one or more non-empty strings")


class SamplingParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    n: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 1
    temperature: Annotated[float, msgspec.Meta(ge=0.0)] = 1.0
    top_k: Annotated[int, msgspec.Meta(ge=-1, le=TOKEN_ID_MAX)] = 0  # 0 or -1: disabled
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 1.0
    min_p: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.0
    seed: NonNegInt | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: Annotated[float, msgspec.Meta(gt=0.0, le=2.0)] = 1.0
    max_tokens: Annotated[int, msgspec.Meta(ge=1, le=TOKEN_ID_MAX)] = 16
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[TokenId] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    # None: off; k >= 0: the sampled token's logprob plus the top-k alternatives.
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Speculative decoding for this request: None takes the deployment's method, "off" opts out;
    # num_speculative_tokens caps k (None: the deployment's).
    speculative: SpecMethod | None = None
    num_speculative_tokens: Annotated[int, msgspec.Meta(ge=0, le=MAX_SPECULATIVE_TOKENS)] | None = None
    # Structured output (JSON schema, regex, choice, grammar): the token mask every step applies. Protocol 13.
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        """What the proxy's own construction needs checked (the wire decoder checks the annotations too)."""
        def bad(name: str, why: str) -> None:
            raise ValueError(f"sampling parameter {name!r} {why} (got {getattr(self, name)!r})")

        def integer(value, low: int, high: int = INT64_MAX) -> bool:
            return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high

        def number(value) -> bool:
            return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value

        if not integer(self.n, 1, 1024):
            bad("n", "must be an integer in [1, 1024]")
        if not number(self.temperature) or self.temperature < 0:
            bad("temperature", "must be >= 0")
        if not integer(self.top_k, 0, TOKEN_ID_MAX):
            bad("top_k", "must be an integer >= 0 (0 or -1 disables it)")
        if not number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            bad("top_p", "must be in (0, 1]")
        if not number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            bad("min_p", "must be in [0, 1]")
        if self.seed is not None and not integer(self.seed, 0):
            bad("seed", "must be a non-negative 64-bit integer")
        if not number(self.presence_penalty) or not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", "must be in [-2, 2]")
        if not number(self.frequency_penalty) or not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", "must be in [-2, 2]")
        if not number(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 2.0:
            bad("repetition_penalty", "must be in (0, 2]")
        if not integer(self.max_tokens, 1, TOKEN_ID_MAX):
            bad("max_tokens", "must be an integer >= 1")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "must be non-empty strings")
        if any(not integer(t, 0, TOKEN_ID_MAX) for t in self.stop_token_ids):
            bad("stop_token_ids", "must be non-negative integers")
        if self.speculative not in (None, *SPEC_METHODS):
            bad("speculative", 'must be null, "off", "ngram" or "draft"')
        if self.num_speculative_tokens is not None and not integer(self.num_speculative_tokens, 0,
                                                                  MAX_SPECULATIVE_TOKENS):
            bad("num_speculative_tokens", f"must be an integer in [0, {MAX_SPECULATIVE_TOKENS}]")
        if self.logprobs is not None and not integer(self.logprobs, 0, MAX_LOGPROBS):
            bad("logprobs", f"must be an integer in [0, {MAX_LOGPROBS}]")
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            bad("structured", "must be a StructuredOutput")

    def replace(self, **changes) -> "SamplingParams":
        """A copy with ``changes``, validated again."""
        return msgspec.structs.replace(self, **changes)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def needs_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )
