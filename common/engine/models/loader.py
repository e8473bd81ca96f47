"""Build a model from a Hugging Face model directory and load its safetensors.

Accepts a single ``model.safetensors`` or a sharded checkpoint with
``model.safetensors.index.json``. Separate q/k/v and gate/up tensors are
copied into the fused projections. Every parameter must be filled exactly
once; anything missing or unexpected is an error naming the tensors. Only the
model's own weights stay resident: each checkpoint tensor is read, copied into
its parameter and dropped, and the files are memory-mapped, not read whole.

At tensor parallelism a rank reads only its slice of each sharded tensor
(``_slice``): rows of q/k/v, gate/up, the embedding and LM head, columns of the
output and down projections, whose biases every rank holds whole (added once).

The configuration (``load_hf_config``) is config.json read as it is when it is a Llama or Qwen2 one that states
every field the models read without a default and leaves RoPE unscaled: the models' own defaults for the rest are
those of transformers' config classes, whose import would cost every worker (and each of its ranks) 0.7-1 s of
CPU at start. Any other configuration goes through transformers' ``AutoConfig``, with its defaults and scalings.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors import safe_open

from common.engine.models.llama import LlamaForCausalLM
from common.engine.tensor_parallel import Parallel
from common.storage.safetensors_files import checkpoint_files

_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_FUSED_RE = re.compile(r"^(.*)\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$")


# What config.json must state for it to be read as it is (``load_hf_config``)
_STATED = ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "rms_norm_eps",
           "vocab_size", "max_position_embeddings", "tie_word_embeddings")
_PLAIN_TYPES = {"llama", "qwen2"}  # whose config classes default the rest as the models do (head_dim, biases, ...)


def load_hf_config(model_dir: str | Path):
    """The model's configuration: config.json as a namespace, or transformers' ``AutoConfig`` (module docstring)."""
    path = Path(model_dir) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        raw = {}  # AutoConfig says what is wrong with it
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if (isinstance(raw, dict) and raw.get("model_type") in _PLAIN_TYPES and all(k in raw for k in _STATED)
            and isinstance(rope, dict) and rope.get("rope_type", rope.get("type", "default")) == "default"
            and "rope_theta" in {**raw, **rope}):
        return SimpleNamespace(**raw)
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(str(model_dir))


def load_model(model_dir: str | Path, dtype: torch.dtype, device: str, backend,
               tp: Parallel | None = None) -> LlamaForCausalLM:
    """The model of ``model_dir``, or ``tp``'s rank's slice of it."""
    cfg = load_hf_config(model_dir)
    tp = tp or Parallel()
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, backend, tp)
    _allocate(model, dtype, device)
    model.rope.build_table(device)
    params = dict(model.named_parameters())
    filled: dict[str, int] = {name: 0 for name in params}
    unexpected = []
    for path in checkpoint_files(Path(model_dir)):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                target, part = _target(name, model)
                if target is None:
                    continue
                if target not in params:
                    unexpected.append(name)
                    continue
                _copy_into(params[target], target, part, _slice(f, name, target, part, model, tp), model)
                filled[target] += 1
    missing = [n for n, count in filled.items() if count != _parts_of(n)]
    if missing or unexpected:
        raise ValueError(
            f"checkpoint in {model_dir} does not match the model: "
            f"missing {missing[:8]}{'...' if len(missing) > 8 else ''}, "
            f"unexpected {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}"
        )
    return model.eval()


def _allocate(model: torch.nn.Module, dtype: torch.dtype, device: str) -> None:
    """A model built on the meta device gets its tensors, uninitialized: floating ones in ``dtype``, allocated
    once in it (no float32 copy first). What ``model.to(dtype).to_empty(device)`` does, without torch's meta
    tensor path (a Python ``empty_like`` of 1-2 ms a tensor, 0.2 s a worker start); a tensor two modules share
    stays shared."""
    made: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for store in (module._parameters, module._buffers):
            for name, meta in store.items():
                if meta is None:
                    continue
                if id(meta) not in made:
                    data = torch.empty(meta.shape, dtype=dtype if meta.is_floating_point() else meta.dtype,
                                       device=device)
                    made[id(meta)] = torch.nn.Parameter(data, requires_grad=meta.requires_grad) \
                        if isinstance(meta, torch.nn.Parameter) else data
                store[name] = made[id(meta)]


def _parts_of(param_name: str) -> int:
    if ".qkv_proj." in param_name:
        return 3
    if ".gate_up_proj." in param_name:
        return 2
    return 1


def _target(name: str, model: LlamaForCausalLM) -> tuple[str | None, int | None]:
    """Map a checkpoint tensor name to (parameter name, part of a fused parameter)."""
    if name.startswith("lm_head.") and model.tie_word_embeddings:
        return None, None
    if "rotary_emb" in name:
        return None, None
    name = name.removeprefix("model.")
    m = _FUSED_RE.match(name)
    if m:
        prefix, proj, kind = m.groups()
        fused, part = _FUSED[proj]
        return f"{prefix}.{fused}.{kind}", part
    return name, None


def _slice(f, name: str, target: str, part: int | None, model: LlamaForCausalLM, tp: Parallel) -> torch.Tensor:
    """This rank's slice of checkpoint tensor ``name`` (the whole tensor at tensor parallelism 1)."""
    if tp.size == 1:
        return f.get_tensor(name)
    view = f.get_slice(name)
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    if target.endswith(("embed_tokens.weight", "lm_head.weight")):
        start, rows = model.vocab_start, model.embed_tokens.weight.shape[0]
        return view[start:start + rows]  # the last rank's slice may be shorter: padded in _copy_into
    if ".qkv_proj." in target:
        width = attn.q_size if part == 0 else attn.kv_size
        return view[tp.rank * width:(tp.rank + 1) * width]
    if ".gate_up_proj." in target:
        return view[tp.rank * mlp.intermediate:(tp.rank + 1) * mlp.intermediate]
    if target.endswith(("o_proj.weight", "down_proj.weight")):
        width = attn.q_size if "o_proj" in target else mlp.intermediate
        return view[:, tp.rank * width:(tp.rank + 1) * width]
    return view[:]


def _copy_into(param: torch.Tensor, target: str, part: int | None, tensor: torch.Tensor,
               model: LlamaForCausalLM) -> None:
    if target.endswith(("embed_tokens.weight", "lm_head.weight")) and tensor.shape[0] < param.shape[0]:
        with torch.no_grad():  # the vocabulary's padding rows on the last rank
            param[tensor.shape[0]:].zero_()
        param = param[:tensor.shape[0]]
    if part is None:
        dest = param
    else:
        if ".qkv_proj." in target:
            attn = model.layers[0].self_attn
            sizes = [attn.q_size, attn.kv_size, attn.kv_size]
        else:
            sizes = [model.layers[0].mlp.intermediate] * 2
        dest = param.narrow(0, sum(sizes[:part]), sizes[part])
    if dest.shape != tensor.shape:
        raise ValueError(
            f"shape mismatch for {target}: checkpoint {tuple(tensor.shape)} vs model {tuple(dest.shape)}"
        )
    with torch.no_grad():
        dest.copy_(tensor.to(dest.dtype))
