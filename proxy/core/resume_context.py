"""What a resumable stream carries to its decode workers (and to the shared store) so that another proxy can take it
over when this one dies.

Each choice of a resumable stream (of ``n`` choices times its prompts) sends, with each ``DecodeRequest``, its
response id (``resume_key``), its window and an opaque context (``encode``): the edge's part (``static``: the request
body and what rebuilds the response, ``proxy.edge.takeover``), the choice's wire parameters, seed and prompt, its
index, its prompt's index and the response's number of choices, and the events it emitted before that decode
started (the prefill's first token, a resumed attempt's earlier output). The worker keeps it with every TokenDelta
it emits (``common/runtime/proxy_links.py``); the proxy taking over replays the events then the deltas, one event
each, through the same response pipeline. With one choice the client's events come out numbered as before; with
the client's token counts (its ``Last-Event-ID``), only those past them, whatever the choices' interleaving
(``proxy.edge.replay``).

The contexts of every choice less their events (``stored``) go to the shared store while the stream runs
(``proxy.edge.shared_streams``): a choice that no worker holds (its proxy and its decode worker both lost, or it
ended before its proxy did) is computed again from its context on a live worker (``Cluster.recompute``), with the
same seed.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from common.protocol.sampling_params import SamplingParams
from common.protocol.wire import TokenDelta

_encode = msgspec.msgpack.Encoder().encode


@dataclass
class ResumeInfo:
    """A resumable choice's: its response id, its window, the edge's part of its context (msgpack), its events
    so far, as ``TokenEvent`` fields less the index (``event_fields``), its index, its prompt's, and the number of
    the response's choices."""
    key: str
    window_s: float
    static: bytes
    events: list[list] = field(default_factory=list)
    index: int = 0
    prompt_index: int = 0
    choices: int = 1

    @classmethod
    def of(cls, key: str, window_s: float, context: "Context", events: list[list]) -> "ResumeInfo":
        """A choice's, from its stored or handed-over ``context``, with ``events`` so far."""
        return cls(key, window_s, context.static, events, context.index, context.prompt_index, context.choices)

    def choice(self, index: int, prompt_index: int) -> "ResumeInfo":
        """The same response's, for its choice ``index`` (of prompt ``prompt_index``), with no events yet."""
        return ResumeInfo(self.key, self.window_s, self.static, [], index, prompt_index, self.choices)


class Context(msgspec.Struct, array_like=True):
    static: bytes
    tenant: str
    params: SamplingParams
    seed: int
    prompt: list[int]
    model: tuple[str, str] | None
    events: list[list]
    index: int = 0
    prompt_index: int = 0
    choices: int = 1


def encode(info: ResumeInfo, tenant: str, params: SamplingParams, seed: int, prompt: list[int],
           model: tuple[str, str] | None) -> bytes:
    return _encode(_context(info, tenant, params, seed, prompt, model, info.events))


def _context(info: ResumeInfo, tenant: str, params: SamplingParams, seed: int, prompt: list[int],
             model: tuple[str, str] | None, events: list[list]) -> Context:
    return Context(info.static, tenant, params, seed, prompt, model, events, info.index, info.prompt_index,
                   info.choices)


def stored(subs) -> bytes:
    """A resumable response's choices (``SubRequest``s with ``resume``) as the shared store keeps them: every
    choice's context, with no events."""
    return _encode([_context(s.resume, s.tenant, s.params, s.seed, s.prompt, s.model, []) for s in subs])


def kept(contexts: list[Context]) -> bytes:
    """``contexts`` (every choice's) as ``stored`` keeps them (a proxy that took the stream over keeps them so)."""
    return _encode([msgspec.structs.replace(context, events=[]) for context in contexts])


def decode(raw: bytes) -> Context:
    """ValueError when ``raw`` is not a context of this release."""
    try:
        return msgspec.msgpack.decode(raw, type=Context)
    except msgspec.MsgspecError as error:
        raise ValueError(f"not a resume context: {error}") from None


def decode_stored(raw: bytes) -> list[Context]:
    """``stored``'s contexts, by index; ValueError when ``raw`` is not what ``stored`` writes."""
    try:
        contexts = msgspec.msgpack.decode(raw, type=list[Context])
    except msgspec.MsgspecError as error:
        raise ValueError(f"not the resume contexts of a stream: {error}") from None
    if not contexts or [c.index for c in contexts] != list(range(contexts[0].choices)):
        raise ValueError("not the resume contexts of every choice of a stream")
    prompts = {c.prompt_index for c in contexts}
    if prompts != set(range(len(prompts))):
        raise ValueError("the choices' prompt indexes are not 0, 1, ... of their prompts")
    return contexts


def event_fields(text: str, token_ids: list[int], logprobs, top_logprobs, finish_reason, stop_reason,
                 num_cached_tokens: int) -> list:
    return [text, token_ids, logprobs, top_logprobs, finish_reason, stop_reason, num_cached_tokens]


def delta_fields(delta: TokenDelta) -> list:
    return event_fields(delta.text, delta.token_ids, delta.logprobs, delta.top_logprobs, delta.finish_reason,
                        delta.stop_reason, delta.num_cached_tokens)
