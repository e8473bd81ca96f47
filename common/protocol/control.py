"""Wire messages that do not ride one request's way: a worker joining, leaving and finding its peers; the
adaptive controller's engine settings; embeddings; the tokenizer a worker's model directory holds. Pure
declarations: ``wire.py`` frames them, lists them in its message table and re-exports them; its docstring tells the
conversations.
"""
from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from common.protocol.sampling_params import TOKEN_ID_MAX
from common.protocol.wire_types import NonNegInt, TokenId, _Struct

# A hex sha256 (common/text/tokenizer_files.py ``tokenizer_sha256``); empty in a Register: not reported.
Sha256 = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{64}$")]
# What one TokenizerFiles may carry: a tokenizer's few files, each named as in a model directory (no path: the proxy
# writes them under its cache root), 64 MiB in all (the largest tokenizer.json files are a few tens of MiB).
TOKENIZER_MAX_FILES = 32
TOKENIZER_MAX_BYTES = 64 << 20
FileName = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_][A-Za-z0-9._-]*$", max_length=255)]


class KVLayoutInfo(_Struct):
    num_layers: Annotated[int, msgspec.Meta(ge=1, le=4096)]
    block_size: Annotated[int, msgspec.Meta(ge=1, le=1 << 16)]
    num_kv_heads: Annotated[int, msgspec.Meta(ge=1, le=4096)]
    head_dim: Annotated[int, msgspec.Meta(ge=1, le=1 << 16)]
    dtype: str


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
    # speculation as configured (engine.spec_num_tokens, spec_max_batch_size); 0, 0: it does not speculate
    spec_num_tokens: NonNegInt = 0
    spec_max_batch_size: NonNegInt = 0
    # the cores it time-shares with other workers (host name and worker.core_share); "": cores of its own
    core_group: Annotated[str, msgspec.Meta(max_length=4096)] = ""
    # the other models (name@version) it may load when the proxy asks (LoadModel; worker.standby_models)
    standby: Annotated[list[Annotated[str, msgspec.Meta(max_length=4096)]], msgspec.Meta(max_length=1024)] = []
    load_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0  # how long loading the model it serves took
    # the hash of its model directory's tokenizer files, which it sends when asked (FetchTokenizer); "": it cannot
    tokenizer_sha256: Annotated[str, msgspec.Meta(pattern="^([0-9a-f]{64})?$")] = ""


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
