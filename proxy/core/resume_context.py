"""What a resumable stream carries to its decode worker (and to the shared store) so that another proxy can take it
over when this one dies.

A stream's choice (one: a response of ``n`` > 1 or of several prompts is not resumable past its proxy, as the
order its choices' events interleaved in is this proxy's alone) sends, with each ``DecodeRequest``, its response id
(``resume_key``), its window and an opaque context (``encode``): the edge's part (``static``: the request body and
what rebuilds the response, ``proxy.edge.takeover``), the choice's wire parameters, seed and prompt, and the events
it emitted before that decode started (the prefill's first token, a resumed attempt's earlier output). The worker
keeps it with every TokenDelta it emits (``common/runtime/proxy_links.py``); the proxy taking over replays the events
then the deltas, one event each, through the same response pipeline, and the client's events come out numbered as
before (or, with the client's token count, only those past it: ``proxy.edge.replay``).

The same context less its events (``stored``) goes to the shared store while the stream runs
(``proxy.edge.shared_streams``): when its proxy and its decode worker are both lost, another proxy computes the
choice again from it on a live worker (``Cluster.recompute``), with the same seed.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from common.protocol.sampling_params import SamplingParams
from common.protocol.wire import TokenDelta

_encode = msgspec.msgpack.Encoder().encode


@dataclass
class ResumeInfo:
    """A resumable choice's: its response id, its window, the edge's part of its context (msgpack) and its events
    so far, as ``TokenEvent`` fields less the index (``event_fields``)."""
    key: str
    window_s: float
    static: bytes
    events: list[list] = field(default_factory=list)


class Context(msgspec.Struct, array_like=True):
    static: bytes
    tenant: str
    params: SamplingParams
    seed: int
    prompt: list[int]
    model: tuple[str, str] | None
    events: list[list]


def encode(info: ResumeInfo, tenant: str, params: SamplingParams, seed: int, prompt: list[int],
           model: tuple[str, str] | None) -> bytes:
    return _encode(Context(info.static, tenant, params, seed, prompt, model, info.events))


def stored(sub) -> bytes:
    """A resumable choice's (a ``SubRequest`` with ``resume``) context for the shared store: no events."""
    info = sub.resume
    return encode(ResumeInfo(info.key, info.window_s, info.static), sub.tenant, sub.params, sub.seed, sub.prompt,
                  sub.model)


def bare(context: Context) -> bytes:
    """``context`` less its events, as ``stored`` keeps it (a proxy that took the stream over keeps it so)."""
    return _encode(msgspec.structs.replace(context, events=[]))


def decode(raw: bytes) -> Context:
    """ValueError when ``raw`` is not a context of this release."""
    try:
        return msgspec.msgpack.decode(raw, type=Context)
    except msgspec.MsgspecError as error:
        raise ValueError(f"not a resume context: {error}") from None


def event_fields(text: str, token_ids: list[int], logprobs, top_logprobs, finish_reason, stop_reason,
                 num_cached_tokens: int) -> list:
    return [text, token_ids, logprobs, top_logprobs, finish_reason, stop_reason, num_cached_tokens]


def delta_fields(delta: TokenDelta) -> list:
    return event_fields(delta.text, delta.token_ids, delta.logprobs, delta.top_logprobs, delta.finish_reason,
                        delta.stop_reason, delta.num_cached_tokens)
