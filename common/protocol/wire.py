"""The wire protocol between the proxy and the workers: every message declared once, its framing, and block
hashing (one concept, hence the length).

A message is ZeroMQ multipart: ``[header, msgpack body]`` (a ROUTER adds the
peer identity in front). The header is two bytes, the message type and the
protocol version; the body is a msgpack map of the message's fields. Versions
one apart interoperate: each side reads the other's and writes in the older of
the two (``versions.py``; the proxy keeps each worker's, a worker the proxy's). Every
message type is a msgspec Struct declared once here, with each field's type
and bounds (token ids, block ids and counts are non-negative and bounded, so
an out-of-range integer is refused here rather than crashing a worker later).
Decoding checks the header, the field names, every field's type and bound,
and raises ``WireError`` naming the field by its path (``$.params.top_k``)
for anything that does not fit; the receiver logs, counts and drops it. KV
bytes never travel here: pages are named by block ids and moved by
``kv_transfer``.

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
  token + the pages it holds under a lease). A resumed request (its worker
  was lost mid-stream) carries its output so far in both requests: the
  worker computes it with the prompt and samples the token after it.
- proxy -> decode: DecodeRequest (pages to pull, or none: prefill locally);
  decode -> proxy: one TokenDeltas per engine step, with a TokenDelta for each request the step
  advanced (a request's last one has finish_reason), KVPulled.
- A pipelined hand-off (protocol 21, a prompt of at least ``kv_pipeline.min_tokens``): the proxy sends the decode
  worker its DecodeRequest with ``kv_pipelined`` as it sends the PrefillRequest (``kv_pipeline_layer_groups``),
  and the decode worker reserves the blocks. prefill -> proxy -> decode: KVProgress, each time a layer group of a
  prompt chunk is computed (the full blocks and the layers ready); the decode worker pulls them at once. After
  PrefillDone the proxy sends the decode worker the plain DecodeRequest, and it pulls what is left.
- proxy -> prefill: ReleaseKV once the pages are pulled (or abandoned).
- proxy -> any worker: Abort. worker -> proxy: RequestFailed.
- proxy -> any worker: Tune, the adaptive controller's engine settings (only with ``tac_enabled``).
- proxy -> prefill (or both): EmbedRequest, token ids of whole inputs; the worker answers EmbedResult, their
  pooled vectors, or RequestFailed.
- proxy -> worker: LoadModel, one of the models its Register (``standby``) or Standby listed. The worker drains,
  says Goodbye, loads it and sends Register under a new epoch. A worker holding no model sends Standby instead of
  Heartbeat (``common/runtime/model_swap.py``).
- proxy -> worker: FetchTokenizer, the tokenizer files whose hash its Register reported (``tokenizer_sha256``),
  for a version the proxy has no tokenizer of; the worker's I/O thread answers TokenizerFiles
  (``proxy/cluster/tokenizer_fetch.py``).
- proxy -> worker: SwitchRole, the planner's or the admin API's order to serve another role. The worker drains as
  for LoadModel, says Goodbye and registers again under a new epoch with the new role, its model still loaded
  (``common/runtime/role_switch.py``).
- worker -> every proxy, on its own PUB socket (``Register.kv_events_endpoint``), not the DEALER: KVEvents, the
  blocks its prefix cache stored and evicted, numbered per epoch (``common/runtime/kv_events.py``). A proxy that
  first sees an epoch, or misses a number, sends KVSnapshotRequest on the link; the worker's I/O thread answers
  KVSnapshot, every block it holds as of one number (``proxy/core/kv_index.py``).

Prompt blocks are named the same way on both sides (``prefix_block_hashes``, at the end): chained hashes of
full KV blocks, the prefix cache's keys. Block i's hash folds in block i-1's, so equal hashes at position i
imply the whole prefix up to i matches; blake2b of the token ids, not Python's ``hash``, so a proxy computes
the hashes a worker's block manager does. Block 0's parent is the request's ``cache_salt`` (0: unsalted): the
proxy gives each tenant its own (``cache_salt_of``), so two tenants' equal prompts never share cached blocks,
and neither can time the other's hits.
"""

from __future__ import annotations

import enum
import hashlib
from array import array
from collections.abc import Sequence
from typing import Annotated, Literal

import msgspec

from common.protocol.sampling_params import INT64_MAX, TOKEN_ID_MAX, SamplingParams
from common.protocol.versions import known_fields, older_body, sendable

NonNegInt = Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)]
TokenId = Annotated[int, msgspec.Meta(ge=0, le=TOKEN_ID_MAX)]
Seconds = Annotated[float, msgspec.Meta(ge=0.0)]
TopLogprobs = list[tuple[TokenId, float]]  # [(token_id, logprob), ...]
Coefficient = Annotated[float, msgspec.Meta(ge=0.0, le=1e9)]  # also refuses NaN
# The root of a request's block hashes (0: unsalted), a uint64: msgpack carries no larger int, and msgspec bounds
# only int64 ranges.
CacheSalt = Annotated[int, msgspec.Meta(ge=0)]


class WireError(ValueError):
    """A frame that is not a valid message of this protocol version."""


class _Struct(msgspec.Struct, forbid_unknown_fields=True):
    """Every message and part of one: unknown fields are refused."""


# 11: EmbedRequest, EmbedResult; 12: LoadModel, Standby; 13: SamplingParams.structured; 14: TokenDeltas.step_rows,
# step; 15: Register.tokenizer_sha256, FetchTokenizer, TokenizerFiles; 18: KVPulled.backend, DecodeRequest.source_epoch;
# 19: Register.kv_events_endpoint, kv_events_public_key, host, KVEvents, KVSnapshotRequest, KVSnapshot; 20: SwitchRole,
# DecodeRequest.resume_key, resume_window_s, resume_context, FindStream, StreamFound, LeaveStream; 21:
# PrefillRequest.kv_pipeline_layer_groups, DecodeRequest.kv_pipelined, KVProgress, Register.interconnect_domain,
# StreamFound.last; 22: Heartbeat.last_decode_taken.
# Versions one apart interoperate (versions.py).
PROTOCOL_VERSION = 22


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
    TOKEN_DELTAS = 13
    KV_PULLED = 14
    RELEASE_KV = 15
    ABORT = 16
    REQUEST_FAILED = 17
    TUNE = 18
    EMBED_REQUEST = 19
    EMBED_RESULT = 20
    STANDBY = 21
    LOAD_MODEL = 22
    FETCH_TOKENIZER = 23
    TOKENIZER_FILES = 24
    KV_EVENTS = 25
    KV_SNAPSHOT_REQUEST = 26
    KV_SNAPSHOT = 27
    SWITCH_ROLE = 28
    FIND_STREAM = 29
    STREAM_FOUND = 30
    LEAVE_STREAM = 31
    KV_PROGRESS = 32


class Role(str, enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"  # aggregated: prefills and decodes its own requests


# -- joining, leaving and finding peers; the controller's settings; embeddings; tokenizers ----------------------

# A hex sha256 (common/text/tokenizer_files.py ``tokenizer_sha256``); empty in a Register: not reported.
Sha256 = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{64}$")]
# What one TokenizerFiles may carry: a tokenizer's few files, each named as in a model directory (no path: the proxy
# writes them under its cache root), 64 MiB in all (the largest tokenizer.json files are a few tens of MiB).
TOKENIZER_MAX_FILES = 32
TOKENIZER_MAX_BYTES = 64 << 20
FileName = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_][A-Za-z0-9._-]*$", max_length=255)]


# A KV element's bytes by the pool's dtype; an int8 pool's rows carry a float32 scale each after their values
# (common/engine/kv_int8.py)
KV_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1, "fp8": 1}
KV_INT8_SCALE_BYTES = 4


class KVLayoutInfo(_Struct):
    num_layers: Annotated[int, msgspec.Meta(ge=1, le=4096)]
    block_size: Annotated[int, msgspec.Meta(ge=1, le=1 << 16)]
    num_kv_heads: Annotated[int, msgspec.Meta(ge=1, le=4096)]
    head_dim: Annotated[int, msgspec.Meta(ge=1, le=1 << 16)]
    dtype: str

    @property
    def bytes_per_token(self) -> int:
        """One token's K and V over every layer and KV head (2 bytes an element for a dtype not named)."""
        row = self.head_dim * KV_DTYPE_BYTES.get(self.dtype, 2) + (KV_INT8_SCALE_BYTES if self.dtype == "int8" else 0)
        return 2 * self.num_layers * self.num_kv_heads * row


class Register(_Struct):
    worker_id: str
    role: Literal["prefill", "decode", "both"]
    epoch: NonNegInt  # start time in ns: a restarted worker with the same id is a new epoch
    model: str
    model_version: str
    kv_layout: KVLayoutInfo
    num_blocks: NonNegInt
    max_model_len: Annotated[int, msgspec.Meta(ge=1, le=TOKEN_ID_MAX)]
    transfer_backend: str
    transfer_metadata: bytes
    max_num_seqs: NonNegInt = 0  # sequences its engine runs at once (decode slots); 0: not reported
    # speculation as configured (engine.spec.num_tokens, spec_max_batch_size); 0, 0: it does not speculate
    spec_num_tokens: NonNegInt = 0
    spec_max_batch_size: NonNegInt = 0
    # the cores it time-shares with other workers (host name and worker.core_share); "": cores of its own
    core_group: Annotated[str, msgspec.Meta(max_length=4096)] = ""
    # the other models (name@version) it may load when the proxy asks (LoadModel; worker.standby_models)
    standby: Annotated[list[Annotated[str, msgspec.Meta(max_length=4096)]], msgspec.Meta(max_length=1024)] = []
    load_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0  # how long loading the model it serves took
    # the hash of its model directory's tokenizer files, which it sends when asked (FetchTokenizer); "": it cannot
    tokenizer_sha256: Annotated[str, msgspec.Meta(pattern="^([0-9a-f]{64})?$")] = ""
    # its ranks (engine.tensor_parallel_size); its pages pair with any worker of the same kv_layout at any size
    tensor_parallel_size: Annotated[int, msgspec.Meta(ge=1, le=64)] = 1
    # where it publishes KVEvents (a ZeroMQ PUB endpoint, tcp://host:port); "": it publishes none
    kv_events_endpoint: Annotated[str, msgspec.Meta(max_length=1024)] = ""
    # with CURVE: that socket's public key (z85), which the proxies pin as its server key; "": CURVE off
    kv_events_public_key: Annotated[str, msgspec.Meta(pattern="^([0-9A-Za-z.:+=^!/*?&<>()\\[\\]{}@%$#-]{40})?$")] = ""
    # the host it runs on (worker.host_name): the proxy pairs prefill and decode workers of one host, whose pages
    # then move over shared memory rather than the network; "": not reported
    host: Annotated[str, msgspec.Meta(max_length=255)] = ""
    # on a GPU of a multi-node NVLink fabric, that fabric (common/runtime/topology.py): the proxy pairs workers of one
    # fabric as it does those of one host; "": in none
    interconnect_domain: Annotated[str, msgspec.Meta(max_length=255)] = ""


class Standby(_Struct):
    """Sent every heartbeat interval by a worker holding no model (it unloaded its own after
    ``model_idle_unload_s``, or a load failed): the models it may load, and why the last load failed, if it did."""
    worker_id: str
    epoch: NonNegInt
    role: Literal["prefill", "decode", "both"]
    models: Annotated[list[Annotated[str, msgspec.Meta(max_length=4096)]], msgspec.Meta(max_length=1024)]
    error: Annotated[str, msgspec.Meta(max_length=8192)] = ""


class LoadModel(_Struct):
    """The proxy asks a worker to serve ``model`` (name@version, one its Register or Standby listed): it stops
    taking work, lets what runs finish (up to its drain_timeout_s), loads it and registers again under a new
    epoch."""
    worker_id: str
    model: Annotated[str, msgspec.Meta(max_length=4096)]


class SwitchRole(_Struct):
    """The proxy asks a worker to serve ``role`` from now on, keeping its model loaded: it stops taking work, lets
    what runs finish (up to its drain_timeout_s; what is left goes back to the proxy, retryable, and resumes
    elsewhere), says Goodbye under its epoch and registers again under a new one with the new role."""
    worker_id: str
    role: Literal["prefill", "decode", "both"]


class RegisterAck(_Struct):
    worker_id: str
    accepted: bool
    reason: str = ""


class Goodbye(_Struct):
    worker_id: str
    epoch: NonNegInt
    reason: str = ""


class Reregister(_Struct):
    worker_id: str
    epoch: NonNegInt  # the epoch of the heartbeat the proxy did not recognise
    reason: str = ""


class PeerInfo(_Struct):
    worker_id: str
    epoch: NonNegInt
    transfer_backend: str
    transfer_metadata: bytes


class Peers(_Struct):
    peers: list[PeerInfo]


class Tune(_Struct):
    """proxy -> any worker: the adaptive controller's setting of the worker's engine (proxy/control/tac.py). Each value
    only restricts what the worker is configured with: a larger one is taken as the configured one, and 0
    (the token budget) or None (speculation) is the configured value."""
    max_num_batched_tokens: NonNegInt = 0  # the step's token budget, so the largest prompt chunk
    spec_num_tokens: Annotated[int, msgspec.Meta(ge=1, le=64)] | None = None  # k, the most drafts per sequence
    spec_max_batch_size: NonNegInt | None = None  # speculate only while at most this many decode (0: never)


class EmbedRequest(_Struct):
    """proxy -> a prefill-capable worker: embed each input (token ids) whole; nothing is cached."""
    request_id: str
    inputs: list[list[TokenId]]


class EmbedResult(_Struct):
    """The inputs' pooled (and, as the model's pooling says, normalized) last hidden states, in order: ``vectors``
    is ``len(inputs) * dim`` little-endian float32 values."""
    request_id: str
    worker_id: str
    dim: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)]
    vectors: bytes
    num_tokens: NonNegInt


class FetchTokenizer(_Struct):
    """proxy -> a worker whose Register reported ``tokenizer_sha256``: send those tokenizer files."""
    worker_id: str
    sha256: Sha256


class TokenizerFiles(_Struct):
    """worker -> proxy, answering FetchTokenizer: its model directory's tokenizer files (name -> bytes), which hash
    to ``sha256``. Bounded in number and in bytes, so a huge or malformed frame is refused as it is decoded."""
    worker_id: str
    sha256: Sha256
    files: Annotated[dict[FileName, Annotated[bytes, msgspec.Meta(max_length=TOKENIZER_MAX_BYTES)]],
                     msgspec.Meta(min_length=1, max_length=TOKENIZER_MAX_FILES)]

    def __post_init__(self) -> None:
        total = sum(map(len, self.files.values()))
        if total > TOKENIZER_MAX_BYTES:
            raise ValueError(f"files of {total} bytes in all; at most {TOKENIZER_MAX_BYTES}")


# -- what a worker's prefix cache holds (common/runtime/kv_events.py publishes it, proxy/core/kv_index.py reads it) --

BlockHash = Annotated[int, msgspec.Meta(ge=0)]  # a chain_hash: a uint64, as CacheSalt
# Blocks one message names at most: a pool of a million blocks and a host tier as large again.
KV_EVENTS_MAX_BLOCKS = 1 << 22


class KVEvents(_Struct):
    """worker -> every proxy (PUB): what its prefix cache gained (``stored``) and lost (``removed``) since its
    previous KVEvents, as chained block hashes (``chain_hash``, rooted at each request's cache salt). ``seq`` counts
    this epoch's KVEvents from 1: a subscriber that sees a number skipped lost one and asks for a KVSnapshot. A hash
    is in at most one of the two lists; each list names distinct hashes."""
    worker_id: str
    epoch: NonNegInt
    seq: NonNegInt
    stored: Annotated[list[BlockHash], msgspec.Meta(max_length=KV_EVENTS_MAX_BLOCKS)] = []
    removed: Annotated[list[BlockHash], msgspec.Meta(max_length=KV_EVENTS_MAX_BLOCKS)] = []


class KVSnapshotRequest(_Struct):
    """proxy -> worker (the link): send every block you hold (the proxy first saw this epoch, or missed a KVEvents)."""
    worker_id: str
    epoch: NonNegInt


class KVSnapshot(_Struct):
    """worker -> the proxy that asked (the link): every block its prefix cache holds once its KVEvents up to ``seq``
    of ``epoch`` are applied; the subscriber applies only those numbered after it."""
    worker_id: str
    epoch: NonNegInt
    seq: NonNegInt
    hashes: Annotated[list[BlockHash], msgspec.Meta(max_length=KV_EVENTS_MAX_BLOCKS)] = []


# -- a worker's load, and one request's way ------------------------------------------------------------------------

def step_cost_features(decode_tokens: int, decode_context: int, prompt_tokens: int = 0,
                       prompt_pairs: int = 0) -> tuple[float, float, float, float, float]:
    """The terms of ``StepCostModel``: 1, decode tokens, decode context (thousands of keys), prompt tokens,
    prompt attention (thousands of query x key pairs)."""
    return 1.0, float(decode_tokens), decode_context / 1e3, float(prompt_tokens), prompt_pairs / 1e3


class StepCostModel(_Struct):
    """A worker's fit of its engine step time (common/engine/model_runner.py), in milliseconds: the dot product
    of a coefficient list with ``step_cost_features``. ``small`` is the fit of decode-only steps of at most
    ``small_max_rows`` rows (the one-call decode kernel's; empty and 0 while unknown), ``large`` of the other
    decode-only steps, ``mixed`` of steps with a prompt chunk (empty while unknown: ``large`` stands in)."""
    small_max_rows: NonNegInt
    small: Annotated[list[Coefficient], msgspec.Meta(max_length=5)]
    large: Annotated[list[Coefficient], msgspec.Meta(min_length=5, max_length=5)]
    mixed: Annotated[list[Coefficient], msgspec.Meta(max_length=5)] = []
    samples: NonNegInt = 0

    @property
    def times_prompts(self) -> bool:
        """Whether the fit has timed prompt steps (``mixed`` is known): without it ``step_ms`` reads a prompt
        step off the decode steps' coefficients, which say nothing of one."""
        return len(self.mixed) == 5

    def step_ms(self, decode_tokens: int, decode_context: int, prompt_tokens: int = 0,
                prompt_pairs: int = 0) -> float:
        if prompt_tokens:
            coef = self.mixed if self.times_prompts else self.large
        elif decode_tokens <= self.small_max_rows and len(self.small) == 5:
            coef = self.small
        else:
            coef = self.large
        x = step_cost_features(decode_tokens, decode_context, prompt_tokens, prompt_pairs)
        return sum(c * v for c, v in zip(coef, x))


class Heartbeat(_Struct):
    worker_id: str
    epoch: NonNegInt
    free_blocks: NonNegInt
    num_running: NonNegInt
    num_waiting: NonNegInt
    outstanding_prefill_tokens: NonNegInt
    draining: bool = False
    context_tokens: NonNegInt = 0  # the running sequences' tokens (prompt and output), summed
    step_cost: StepCostModel | None = None  # None until the worker has fitted its step time
    # The last DecodeRequest from this proxy that the worker's compute loop took before this load was measured
    # (its request_id), so the load counts it and every one this proxy sent before it; "": none yet since it
    # registered with this proxy; None: not said (an older worker): the proxy takes the load to count all it sent.
    last_decode_taken: str | None = None


class PrefillRequest(_Struct):
    request_id: str
    prompt_token_ids: list[TokenId]
    params: SamplingParams
    seed: NonNegInt
    lease_s: Seconds
    # A resumed request's output so far (its decode worker was lost): computed with the prompt; the token
    # sampled after it continues the stream.
    output_token_ids: list[TokenId] = msgspec.field(default_factory=list)
    tenant: str = ""  # who sent it; priority (lane, 0 first) and the tenant's service counter at dispatch
    priority: NonNegInt = 0
    fairness_counter: float = 0.0
    trace_context: dict[str, str] | None = None  # W3C trace context ({"traceparent": ...}) when tracing is on
    cache_salt: CacheSalt = 0  # its tenant's prefix-cache namespace (proxy.tenancy.prefix_cache_sharing); 0: shared
    keep_s: Seconds = 0.0  # a session's turn: keep its blocks cached this long after it ends (block_manager)
    # A pipelined hand-off's: report KVProgress as each of this many groups of layers of a prompt chunk is computed.
    # 0: none (the pages are pulled after PrefillDone).
    kv_pipeline_layer_groups: NonNegInt = 0


class KVProgress(_Struct):
    """A layer group of a pipelined prompt's chunk is computed: ``layer_start`` to ``layer_end`` (excluded) of the
    full blocks ``first_block`` .. ``first_block + len(block_ids) - 1`` of the prompt (``block_ids``: the prefill
    worker's ids of them) hold their final KV. ``generation``: the times the prefill worker's scheduler preempted
    the prompt so far; a preempted prompt is computed again into other blocks, so what was pulled under an earlier
    generation is pulled again. Sent prefill -> proxy, and relayed as it is to the decode worker."""
    request_id: str
    worker_id: str
    epoch: NonNegInt
    generation: NonNegInt
    first_block: NonNegInt
    block_ids: list[NonNegInt]
    layer_start: NonNegInt
    layer_end: NonNegInt


class PrefillDone(_Struct):
    request_id: str
    worker_id: str
    epoch: NonNegInt
    first_token: TokenId
    text: str  # the first token's text delta (held-back text follows from the decode side)
    block_ids: list[NonNegInt]
    num_cached_tokens: NonNegInt
    finish_reason: str | None = None  # set when the first token already ends the request
    stop_reason: int | str | None = None
    logprob: float | None = None
    top_logprobs: TopLogprobs | None = None


class DecodeRequest(_Struct):
    request_id: str
    prompt_token_ids: list[TokenId]
    params: SamplingParams
    seed: NonNegInt
    first_token: TokenId | None = None  # None: no pages, prefill on this worker
    source_worker_id: str | None = None
    source_block_ids: list[NonNegInt] = msgspec.field(default_factory=list)
    # With pages: how much longer the prefill worker holds them (its lease), as the proxy sent this. The pull
    # must be done by then, else the pages may already hold another request's KV. None: no bound.
    kv_lease_left_s: Seconds | None = None
    first_logprob: float | None = None
    first_top_logprobs: TopLogprobs | None = None
    # A resumed request's output before first_token (without pages: its whole output so far).
    output_token_ids: list[TokenId] = msgspec.field(default_factory=list)
    tenant: str = ""  # as on PrefillRequest: decode preempts the lowest lane, highest counter first
    priority: NonNegInt = 0
    fairness_counter: float = 0.0
    trace_context: dict[str, str] | None = None
    cache_salt: CacheSalt = 0  # as on PrefillRequest: the blocks it caches here are its tenant's
    keep_s: Seconds = 0.0  # as on PrefillRequest
    # With pages: the epoch of source_worker_id that lent them (PrefillDone.epoch). A decode worker that knows that
    # worker under another epoch refuses the pull: the pages' ids mean nothing in the new process. 0: not checked.
    source_epoch: NonNegInt = 0
    # A resumable stream's (common/runtime/proxy_links.py): its response id, how long the worker keeps it running
    # for a client to come back to any proxy when this one is lost, and what that proxy needs to rebuild the stream
    # (opaque to the worker: proxy/edge/takeover.py). Empty: not resumable past its proxy.
    resume_key: str = ""
    resume_window_s: Seconds = 0.0
    resume_context: bytes = b""
    # Sent as the prompt goes to source_worker_id, before it is computed (first_token None): reserve the prompt's
    # blocks and pull the layer groups KVProgress names; the DecodeRequest after PrefillDone (first_token set, same
    # request id) names every page, and the rest is pulled then. kv_lease_left_s bounds the wait for it.
    kv_pipelined: bool = False


class TokenDelta(_Struct):
    request_id: str
    token_ids: list[TokenId]
    text: str
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[float] | None = None
    top_logprobs: list[TopLogprobs] | None = None
    num_cached_tokens: NonNegInt = 0


class TokenDeltas(_Struct):
    """What one engine step emitted, one delta per request: one message (one encode, one send, one wake-up of
    the proxy) per step rather than per request. Like any message it is checked whole: one delta out of bounds
    drops the step's message for every request in it (the worker's engine only emits token ids of its vocabulary,
    which the bounds admit).

    A worker serving several proxies sends each the deltas of its own requests (common/runtime/proxy_links.py),
    with the step's size and number so that each times the worker's steps as one proxy would: ``step_rows``, the
    step's sequences across every proxy, and ``step``, the worker's count of steps (a proxy that sees step k + 1
    after k saw two steps in a row; a gap means steps without its requests). 0: one proxy (the deltas are the
    step's), or a worker of protocol 13."""
    deltas: list[TokenDelta]
    step_rows: NonNegInt = 0
    step: NonNegInt = 0


class KVPulled(_Struct):
    request_id: str
    source_worker_id: str
    ok: bool
    num_bytes: NonNegInt = 0
    seconds: Seconds = 0.0
    error: str = ""
    backend: str = ""  # the transfer backend that moved the pages (nixl, zmq); "": not said (an older worker)


class ReleaseKV(_Struct):
    request_id: str


class Abort(_Struct):
    request_id: str


class RequestFailed(_Struct):
    request_id: str
    worker_id: str
    message: str
    retryable: bool = False
    invalid_request: bool = False  # the request itself is unacceptable (the client gets a 400)
    code: str = ""  # the error code the client gets (nonfinite_logits); empty: worker_error (or invalid_request)


class FindStream(_Struct):
    """A proxy asks every worker for the requests of resumable response ``response_id`` whose proxy is gone, to take
    them over (common/runtime/proxy_links.py ``Owners.take_over``). ``tenant``: only that tenant's ("": any)."""
    response_id: str
    tenant: str = ""


class LeaveStream(_Struct):
    """A draining proxy hands a resumable stream over: the worker keeps it for its window as if that proxy were lost,
    for another to take over (``FindStream``)."""
    request_id: str


class StreamFound(_Struct):
    """A worker's answer to FindStream, one per request of the response it holds, or one with status ``absent``.

    ``found``: the request is the asking proxy's from now on; ``history`` holds every TokenDelta the worker emitted
    for it so far (its step boundaries kept), and its later deltas go to that proxy. ``owned``: another proxy that is
    still connected holds it. ``absent``: not here (unknown, another tenant's, or its window closed)."""
    response_id: str
    worker_id: str
    status: Literal["found", "owned", "absent"]
    request_id: str = ""
    context: bytes = b""
    history: list[TokenDelta] = msgspec.field(default_factory=list)
    # whether this is the worker's last answer to the FindStream: a worker holding several requests of the response
    # (its n > 1 choices) sends one each, and the proxy waits for the last before it counts the worker as answered
    last: bool = True


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
    MsgType.TOKEN_DELTAS: TokenDeltas,
    MsgType.KV_PULLED: KVPulled,
    MsgType.RELEASE_KV: ReleaseKV,
    MsgType.ABORT: Abort,
    MsgType.REQUEST_FAILED: RequestFailed,
    MsgType.TUNE: Tune,
    MsgType.EMBED_REQUEST: EmbedRequest,
    MsgType.EMBED_RESULT: EmbedResult,
    MsgType.STANDBY: Standby,
    MsgType.LOAD_MODEL: LoadModel,
    MsgType.FETCH_TOKENIZER: FetchTokenizer,
    MsgType.TOKENIZER_FILES: TokenizerFiles,
    MsgType.KV_EVENTS: KVEvents,
    MsgType.KV_SNAPSHOT_REQUEST: KVSnapshotRequest,
    MsgType.KV_SNAPSHOT: KVSnapshot,
    MsgType.SWITCH_ROLE: SwitchRole,
    MsgType.FIND_STREAM: FindStream,
    MsgType.STREAM_FOUND: StreamFound,
    MsgType.LEAVE_STREAM: LeaveStream,
    MsgType.KV_PROGRESS: KVProgress,
}
_TYPES = {cls: t for t, cls in MESSAGES.items()}
_HEADERS = {cls: bytes([t, PROTOCOL_VERSION]) for t, cls in MESSAGES.items()}
_DECODERS = {t: msgspec.msgpack.Decoder(cls) for t, cls in MESSAGES.items()}
_ENCODER = msgspec.msgpack.Encoder()


def encode(msg, version: int = PROTOCOL_VERSION) -> list[bytes]:
    """A message as ``[header, body]`` frames, for a peer speaking ``version`` (this one, or the one before)."""
    if version >= PROTOCOL_VERSION:
        return [_HEADERS[type(msg)], _ENCODER.encode(msg)]
    if not sendable(type(msg), version):
        raise WireError(f"{type(msg).__name__} is not in protocol version {version}")
    return [bytes([_TYPES[type(msg)], version]), _ENCODER.encode(older_body(msg, version))]


def frame_version(frames: list[bytes]) -> int | None:
    """The protocol version a well-formed frame's header names; None for a frame without a header."""
    return frames[0][1] if len(frames) == 2 and len(frames[0]) == 2 else None


def decode(frames: list[bytes]):
    """Parse ``[header, body]`` of this protocol version or one next to it; raises WireError on anything
    malformed."""
    if len(frames) != 2 or len(frames[0]) != 2:
        raise WireError(f"expected [header, body] frames with a 2-byte header, got {len(frames)} frame(s)")
    kind, version = frames[0]
    try:
        decoder = _DECODERS[MsgType(kind)]
    except ValueError:
        raise WireError(f"unknown message type {kind}") from None
    message_type = MESSAGES[MsgType(kind)]
    name = message_type.__name__
    if abs(version - PROTOCOL_VERSION) > 1:
        raise WireError(f"{name}: protocol version {version}; this process reads {PROTOCOL_VERSION - 1} to "
                        f"{PROTOCOL_VERSION + 1}")
    try:
        if version <= PROTOCOL_VERSION:  # an older peer's: the fields added since take their defaults
            return decoder.decode(frames[1])
        return msgspec.convert(known_fields(msgspec.msgpack.decode(frames[1]), message_type), message_type)
    except msgspec.ValidationError as exc:
        raise WireError(f"{name}: {exc}") from None
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:  # a str that is not UTF-8 raises the latter
        raise WireError(f"{name}: body is not msgpack: {exc}") from None


def refused_request_id(frames: list[bytes]) -> str | None:
    """The request id of a malformed PrefillRequest, DecodeRequest or EmbedRequest, when one can be read from it.

    A worker answers such a request with RequestFailed instead of leaving its client to a timeout:
    the proxy and a worker may disagree on what is acceptable (a float the worker's flush-to-zero
    mode reads as 0, a newer proxy's field).
    """
    if len(frames) != 2 or len(frames[0]) != 2 or frames[0][0] not in (
            MsgType.PREFILL_REQUEST, MsgType.DECODE_REQUEST, MsgType.EMBED_REQUEST):
        return None
    try:
        body = msgspec.msgpack.decode(frames[1])
    except Exception:  # noqa: BLE001 - anything a malformed body raises (DecodeError, UnicodeDecodeError, ...)
        return None
    request_id = body.get("request_id") if isinstance(body, dict) else None
    return request_id if isinstance(request_id, str) and 0 < len(request_id) <= 256 else None


def chain_hash(parent: int | None, token_ids: Sequence[int]) -> int:
    """Stable (process-independent) hash of one full block given its parent's hash.

    Stable so a proxy or another worker can compute the same hashes to route
    requests to the worker whose cache already holds a prompt's prefix. Block
    0's parent is the request's cache salt (0 or None: unsalted).
    """
    h = hashlib.blake2b(digest_size=8)
    h.update((parent if parent is not None else 0).to_bytes(8, "little", signed=False))
    h.update(array("q", token_ids).tobytes())
    return int.from_bytes(h.digest(), "little")


def prefix_block_hashes(token_ids: Sequence[int], block_size: int, cache_salt: int = 0) -> list[int]:
    """Chained hashes of every full block of ``token_ids``, rooted at ``cache_salt``."""
    hashes: list[int] = []
    parent = cache_salt
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = chain_hash(parent, token_ids[start:start + block_size])
        hashes.append(parent)
    return hashes


def cache_salt_of(namespace: str) -> int:
    """The cache salt of a prefix-cache namespace (a tenant or a cache group): never 0, which is unsalted.

    Stable across processes and restarts, so a proxy's routing and every worker's cache agree; blake2b
    personalized apart from the block hashes.
    """
    digest = hashlib.blake2b(namespace.encode(), digest_size=8, person=b"tessera-salt").digest()
    return int.from_bytes(digest, "little") or 1
