"""Protocol versions one apart interoperate: what each version added, and how a frame crosses that one step.

The header's second byte is the protocol's version. A process reads frames of its own version, of the one before
(the fields added since take their defaults) and of the one after (``known_fields`` drops what it does not know);
it writes to each peer in the older of their two versions (``older_body`` leaves out what that version lacks, and
a message type it lacks is not sent at all: ``sendable``). So a proxy and its workers upgrade one at a time, in
either order, as long as no two are more than one version apart.

Rules for a change to the protocol (bump ``wire.PROTOCOL_VERSION`` with it):
- a new field has a default, and an entry in ``FIELD_SINCE``;
- a new message type has an entry in ``MESSAGE_SINCE``, and whoever sends it checks ``sendable`` first;
- a changed meaning, a removed field or a new required one is a new message type, never an edit of an old one.
"""
from __future__ import annotations

from functools import cache

import msgspec
from msgspec import inspect

# The version that added each message type (by name: the messages are declared in wire.py, which imports this
# module), where it is newer than the oldest version still read.
MESSAGE_SINCE: dict[str, int] = {"EmbedRequest": 11, "EmbedResult": 11, "LoadModel": 12, "Standby": 12,
                                 "FetchTokenizer": 15, "TokenizerFiles": 15, "KVEvents": 19,
                                 "KVSnapshotRequest": 19, "KVSnapshot": 19,
                                 "SwitchRole": 20, "FindStream": 20, "StreamFound": 20,
                                 "LeaveStream": 20, "KVProgress": 21}
# The version that added each field (struct name -> field -> version), where it is newer than that.
FIELD_SINCE: dict[str, dict[str, int]] = {"PrefillRequest": {"keep_s": 11, "kv_pipeline_layer_groups": 21},
                                          "DecodeRequest": {"keep_s": 11, "source_epoch": 18, "resume_key": 20,
                                                            "resume_window_s": 20, "resume_context": 20,
                                                            "kv_pipelined": 21},
                                          "SamplingParams": {"structured": 13},
                                          "TokenDeltas": {"step_rows": 14, "step": 14},
                                          "RequestFailed": {"code": 16}, "KVPulled": {"backend": 18},
                                          "StreamFound": {"last": 21}, "Heartbeat": {"last_decode_taken": 22},
                                          "Register": {"standby": 12, "load_s": 12, "tokenizer_sha256": 15,
                                                       "tensor_parallel_size": 17, "kv_events_endpoint": 19,
                                                       "kv_events_public_key": 19, "host": 19,
                                                       "interconnect_domain": 21}}
# A request that uses a field goes only to workers that speak its version: an older one would drop the field
# (``older_body``) and serve the request without what it asks for (``proxy/cluster/cluster.py`` ``_candidates``).
STRUCTURED_SINCE = FIELD_SINCE["SamplingParams"]["structured"]
PIPELINED_SINCE = MESSAGE_SINCE["KVProgress"]  # both workers of a pipelined hand-off speak it


def sendable(message_type: type, version: int) -> bool:
    """Whether a peer speaking ``version`` knows ``message_type``."""
    return MESSAGE_SINCE.get(message_type.__name__, 0) <= version


def older_body(value, version: int):
    """``value`` (a message, or part of one) as msgpack-ready builtins without the fields newer than ``version``."""
    if isinstance(value, msgspec.Struct):
        newer = FIELD_SINCE.get(type(value).__name__, {})
        return {name: older_body(getattr(value, name), version) for name in value.__struct_fields__
                if newer.get(name, 0) <= version}
    if isinstance(value, (list, tuple)):
        return [older_body(item, version) for item in value]
    if isinstance(value, dict):
        return {key: older_body(item, version) for key, item in value.items()}
    return value


def known_fields(raw, message_type: type):
    """A newer peer's decoded body with the fields ``message_type`` (and the structs in it) lacks dropped."""
    return _prune(raw, _info(message_type))


@cache
def _info(message_type: type) -> inspect.Type:
    return inspect.type_info(message_type)


def _prune(value, info: inspect.Type):
    if isinstance(info, inspect.StructType) and isinstance(value, dict):
        fields = {field.encode_name: field.type for field in info.fields}
        return {key: _prune(item, fields[key]) for key, item in value.items() if key in fields}
    if isinstance(info, (inspect.ListType, inspect.VarTupleType)) and isinstance(value, list):
        return [_prune(item, info.item_type) for item in value]
    if isinstance(info, inspect.UnionType):
        for member in info.types:
            if (isinstance(member, inspect.StructType) and isinstance(value, dict)) or (
                    isinstance(member, (inspect.ListType, inspect.VarTupleType)) and isinstance(value, list)):
                return _prune(value, member)
    return value
