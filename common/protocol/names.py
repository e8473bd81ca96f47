"""The closed sets of names the cluster speaks, each defined once.

Each set is a ``Literal`` type, so config models, HTTP models and wire structs
annotate fields with it and their validators, the OpenAPI document and
docs/configuration.md all read the same list; the tuple beside it serves
argparse ``choices`` and messages. Adding a name here adds it everywhere.
"""
from __future__ import annotations

from typing import Literal, get_args

Role = Literal["prefill", "decode", "both"]
Dtype = Literal["float32", "bfloat16"]
Quantization = Literal["none", "int8"]  # weights only; see common/engine/quantization.py
KvCacheDtype = Literal["auto", "int8"]  # the KV pool's: auto keeps the model's dtype; see common/engine/kv_int8.py
DEVICE_PATTERN = r"^(cpu|cuda(:[0-9]+)?)$"  # a torch device a worker's rank may take: cpu, cuda, cuda:N
AttentionBackend = Literal["auto", "torch", "cpu_paged", "flash_attn", "triton"]
SpecMethod = Literal["off", "ngram", "draft"]
TransferBackend = Literal["auto", "nixl", "zmq"]
FairnessPolicy = Literal["fcfs", "priority", "vtc"]
# When decode admission holds each worker to the TPOT target (proxy.slo.tpot_slo_scope)
TpotSloScope = Literal["shared", "always", "never"]
PriorityLane = Literal["p0", "p1", "p2"]  # p0 is served first
# Whose requests share prefix-cache blocks (proxy.tenancy.prefix_cache_sharing): each tenant (or cache group) its own,
# or the whole cluster
PrefixCacheSharing = Literal["tenant", "cluster"]

ROLES: tuple[str, ...] = get_args(Role)
DTYPES: tuple[str, ...] = get_args(Dtype)
SPEC_METHODS: tuple[str, ...] = get_args(SpecMethod)
TRANSFER_BACKENDS: tuple[str, ...] = get_args(TransferBackend)
FAIRNESS_POLICIES: tuple[str, ...] = get_args(FairnessPolicy)
PRIORITY_LANES: tuple[str, ...] = get_args(PriorityLane)
