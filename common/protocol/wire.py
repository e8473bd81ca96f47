"""The wire protocol between the proxy and the workers.

A message is ZeroMQ multipart: ``[type byte, msgpack body]`` (a ROUTER adds
the peer identity in front). Every message type is a dataclass declared
once here, with the type of each field; the body is a msgpack map that also
carries the protocol version. Decoding checks the version, the field names
and every field's type, and raises ``WireError`` for anything that does not
fit, so a malformed message is logged and dropped by the receiver instead of
surfacing as a KeyError deep in a worker. KV bytes never travel here: pages
are named by block ids and moved by ``kv_transfer``.

Conversations (all through the proxy; workers never talk to each other on
this channel):
- worker -> proxy: Register, then Heartbeat every ``heartbeat_interval_s``
  (``draining=True`` once it stops taking work); Goodbye as it exits. The proxy answers RegisterAck, and sends decode
  workers Peers whenever the set of prefill workers changes.
- proxy -> worker: Reregister, answering a Heartbeat from a worker id or
  epoch it does not know (it restarted, or expired the worker). The worker
  drops the requests it ran for the old proxy, frees their pages, and sends
  its Register again (same id and epoch: the same process rejoins).
- proxy -> prefill: PrefillRequest; prefill -> proxy: PrefillDone (first
  token + the pages it holds under a lease).
- proxy -> decode: DecodeRequest (pages to pull, or none: prefill locally);
  decode -> proxy: TokenDelta ... (last one has finish_reason), KVPulled.
- proxy -> prefill: ReleaseKV once the pages are pulled (or abandoned).
- proxy -> any worker: Abort. worker -> proxy: RequestFailed.
"""
from __future__ import annotations

import dataclasses
import enum
import types
import typing
from dataclasses import dataclass, field

import msgpack

PROTOCOL_VERSION = 1


class WireError(ValueError):
    """A frame that is not a valid message of this protocol version."""


class MsgType(enum.IntEnum):
    REGISTER = 1
    REGISTER_ACK = 2
    HEARTBEAT = 3
    GOODBYE = 4
    PEERS = 5
    REREGISTER = 6
    PREFILL_REQUEST = 10
    PREFILL_DONE = 11
    DECODE_REQUEST = 12
    TOKEN_DELTA = 13
    KV_PULLED = 14
    RELEASE_KV = 15
    ABORT = 16
    REQUEST_FAILED = 17


class Role(str, enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"  # aggregated: prefills and decodes its own requests


@dataclass
class KVLayoutInfo:
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str


@dataclass
class Register:
    worker_id: str
    role: str
    epoch: int  # start time in ns: a restarted worker with the same id is a new epoch
    model: str
    model_version: str
    kv_layout: KVLayoutInfo
    num_blocks: int
    max_model_len: int
    transfer_backend: str
    transfer_metadata: bytes
    max_num_seqs: int = 0  # sequences its engine runs at once (decode slots); 0: not reported


@dataclass
class RegisterAck:
    worker_id: str
    accepted: bool
    reason: str = ""


@dataclass
class Heartbeat:
    worker_id: str
    epoch: int
    free_blocks: int
    num_running: int
    num_waiting: int
    outstanding_prefill_tokens: int
    draining: bool = False


@dataclass
class Goodbye:
    worker_id: str
    epoch: int
    reason: str = ""


@dataclass
class Reregister:
    worker_id: str
    epoch: int  # the epoch of the heartbeat the proxy did not recognise
    reason: str = ""


@dataclass
class PeerInfo:
    worker_id: str
    epoch: int
    transfer_backend: str
    transfer_metadata: bytes


@dataclass
class Peers:
    peers: list[PeerInfo]


@dataclass
class PrefillRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: dict  # SamplingParams.to_dict()
    seed: int
    lease_s: float
    tenant: str = ""  # who sent it; priority (lane, 0 first) and the tenant's service counter at dispatch
    priority: int = 0
    fairness_counter: float = 0.0
    trace_context: dict | None = None  # W3C trace context ({"traceparent": ...}) when tracing is on


@dataclass
class PrefillDone:
    request_id: str
    worker_id: str
    epoch: int
    first_token: int
    text: str  # the first token's text delta (held-back text follows from the decode side)
    block_ids: list[int]
    num_cached_tokens: int
    finish_reason: str | None = None  # set when the first token already ends the request
    stop_reason: int | str | None = None
    logprob: float | None = None
    top_logprobs: list[list] | None = None  # [[token_id, logprob], ...]


@dataclass
class DecodeRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: dict
    seed: int
    first_token: int | None = None  # None: no pages, prefill on this worker
    source_worker_id: str | None = None
    source_block_ids: list[int] = field(default_factory=list)
    first_logprob: float | None = None
    first_top_logprobs: list[list] | None = None
    tenant: str = ""  # as on PrefillRequest: decode preempts the lowest lane, highest counter first
    priority: int = 0
    fairness_counter: float = 0.0
    trace_context: dict | None = None


@dataclass
class TokenDelta:
    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[float] | None = None
    top_logprobs: list[list[list]] | None = None
    num_cached_tokens: int = 0


@dataclass
class KVPulled:
    request_id: str
    source_worker_id: str
    ok: bool
    num_bytes: int = 0
    seconds: float = 0.0
    error: str = ""


@dataclass
class ReleaseKV:
    request_id: str


@dataclass
class Abort:
    request_id: str


@dataclass
class RequestFailed:
    request_id: str
    worker_id: str
    message: str
    retryable: bool = False
    invalid_request: bool = False  # the request itself is unacceptable (the client gets a 400)


MESSAGES: dict[MsgType, type] = {
    MsgType.REGISTER: Register,
    MsgType.REGISTER_ACK: RegisterAck,
    MsgType.HEARTBEAT: Heartbeat,
    MsgType.GOODBYE: Goodbye,
    MsgType.PEERS: Peers,
    MsgType.REREGISTER: Reregister,
    MsgType.PREFILL_REQUEST: PrefillRequest,
    MsgType.PREFILL_DONE: PrefillDone,
    MsgType.DECODE_REQUEST: DecodeRequest,
    MsgType.TOKEN_DELTA: TokenDelta,
    MsgType.KV_PULLED: KVPulled,
    MsgType.RELEASE_KV: ReleaseKV,
    MsgType.ABORT: Abort,
    MsgType.REQUEST_FAILED: RequestFailed,
}
TYPE_OF = {cls: t for t, cls in MESSAGES.items()}


def encode(msg) -> list[bytes]:
    """A message as ``[type byte, body]`` frames."""
    body = dataclasses.asdict(msg)
    body["v"] = PROTOCOL_VERSION
    return [bytes([TYPE_OF[type(msg)]]), msgpack.packb(body, use_bin_type=True)]


def decode(frames: list[bytes]):
    """Parse ``[type byte, body]``; raises WireError on anything malformed."""
    if len(frames) != 2 or len(frames[0]) != 1:
        raise WireError(f"expected [type, body] frames, got {len(frames)} frame(s)")
    try:
        cls = MESSAGES[MsgType(frames[0][0])]
    except ValueError:
        raise WireError(f"unknown message type {frames[0][0]}") from None
    try:
        body = msgpack.unpackb(frames[1], raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise WireError(f"{cls.__name__}: body is not msgpack: {exc}") from None
    if not isinstance(body, dict):
        raise WireError(f"{cls.__name__}: body is not a map")
    version = body.pop("v", None)
    if version != PROTOCOL_VERSION:
        raise WireError(f"{cls.__name__}: protocol version {version!r}, expected {PROTOCOL_VERSION}")
    return _build(cls, body, cls.__name__)


def _build(cls, data, where: str):
    if not isinstance(data, dict):
        raise WireError(f"{where}: expected a map")
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(data) - set(known)
    if unknown:
        raise WireError(f"{where}: unknown fields {sorted(unknown)}")
    values = {}
    for name, f in known.items():
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise WireError(f"{where}: missing field {name!r}")
            continue
        values[name] = _check(hints[name], data[name], f"{where}.{name}")
    return cls(**values)


def _check(tp, value, where: str):
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(tp):
            try:
                return _check(option, value, where)
            except WireError:
                continue
        raise WireError(f"{where}: {type(value).__name__} fits none of {tp}")
    if tp is type(None):
        if value is not None:
            raise WireError(f"{where}: expected null")
        return None
    if origin is list:
        if not isinstance(value, list):
            raise WireError(f"{where}: expected a list, got {type(value).__name__}")
        (item,) = typing.get_args(tp) or (typing.Any,)
        return [_check(item, v, f"{where}[]") for v in value]
    if tp is typing.Any:
        return value
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, where)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is int and isinstance(value, bool):
        raise WireError(f"{where}: expected int, got bool")
    if tp in (int, float, str, bool, bytes, dict, list) and isinstance(value, tp):
        return value
    raise WireError(f"{where}: expected {getattr(tp, '__name__', tp)}, got {type(value).__name__}")
