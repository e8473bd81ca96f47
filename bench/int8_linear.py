"""int8 (W8A8) against bfloat16 on the embedded model's layer shapes, as prompt chunks and large decode batches see them.

    .venv/bin/python -m bench.int8_linear [--rows 16 64 256 512 1024] [--threads 2]

Per number of rows, the summed time of the four linear layers of one decoder
layer (q/k/v, o, gate/up, down; shapes from the model's config), ms:
- bf16: the weight prepacked for oneDNN, as bfloat16 serving runs it without AVX512-BF16 (with it, the
  panels: bench.panel_gemm, at 1.00-1.06x this from 24 rows);
- W8A8, torch passes: per-row activation quantization and dequantization as
  torch operators around ``torch._int_mm`` (the second round's path);
- W8A8: the same with the C passes (``kernels/quant.c``), as served now;
- ``_int_mm`` alone: the int8 matmul with nothing around it, the floor.
And the MLP (gate/up, SiLU * up, down): bf16 with the C SiLU pass, int8 layer
by layer, and int8 with the middle in one C pass (``quantization.mlp_int8``).
"""
from __future__ import annotations

import argparse
import json
import time
from types import SimpleNamespace

import torch

from common.engine.models.llama import MLP, prepack
from common.engine.quantization import linear_int8, mlp_int8, quantize_rows
from common.storage.model_store import embedded_model_dir


def per_call_ms(fn, repeat: int) -> float:
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return 1000 * (time.perf_counter() - start) / repeat


def torch_passes(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    x_scale = xf.abs().amax(dim=1).clamp_(min=1e-8) / 127.0
    xq = torch.round(xf / x_scale[:, None]).to(torch.int8)
    return (torch._int_mm(xq, q.t()).float() * x_scale[:, None] * scale).to(x.dtype)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 64, 256, 512, 1024])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = json.loads((embedded_model_dir("bfloat16") / "config.json").read_text())
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = hidden // cfg["num_attention_heads"]
    qkv = (cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"]) * head_dim
    shapes = [(qkv, hidden), (hidden, hidden), (2 * inter, hidden), (hidden, inter)]  # (out, in)
    gen = torch.Generator().manual_seed(0)
    layers = []
    for n, k in shapes:
        w = (torch.randn(n, k, generator=gen) * 0.05).bfloat16()
        q, scale = quantize_rows(w)
        layers.append((k, prepack(w), q, scale))
    mlp_config = SimpleNamespace(hidden_size=hidden, intermediate_size=inter, mlp_bias=False, hidden_act="silu")
    mlp, mlp_int8_layers = MLP(mlp_config).bfloat16(), MLP(mlp_config)
    for bf16_linear, int8_linear in ((mlp.gate_up_proj, mlp_int8_layers.gate_up_proj),
                                     (mlp.down_proj, mlp_int8_layers.down_proj)):
        bf16_linear.packed = prepack(bf16_linear.weight)
        q, scale = quantize_rows(bf16_linear.weight.data)
        del int8_linear.weight
        int8_linear.register_buffer("weight", q)
        int8_linear.register_buffer("weight_scale", scale)

    print(f"{args.threads} threads; the four linear layers of one decoder layer ({hidden} hidden, {inter} "
          f"intermediate), ms per call summed, mean of {args.repeat}\n")
    print("| rows | bf16 (prepacked) | W8A8, torch passes | W8A8 (C passes) | `_int_mm` alone | bf16 / W8A8 |")
    print("|---|---|---|---|---|---|")
    for rows in args.rows:
        xs = {k: torch.randn(rows, k, generator=gen).bfloat16() for k in (hidden, inter)}
        xq = {k: torch.randint(-127, 128, (rows, k), dtype=torch.int8, generator=gen) for k in (hidden, inter)}
        bf16 = sum(per_call_ms(lambda: torch.ops.mkldnn._linear_pointwise(xs[k], p, None, "none", [], ""), args.repeat)
                   for k, p, _, _ in layers)
        torch_ms = sum(per_call_ms(lambda: torch_passes(xs[k], q, s), args.repeat) for k, _, q, s in layers)
        c_ms = sum(per_call_ms(lambda: linear_int8(xs[k], q, s, None), args.repeat) for k, _, q, s in layers)
        floor = sum(per_call_ms(lambda: torch._int_mm(xq[k], q.t()), args.repeat) for k, _, q, _ in layers)
        print(f"| {rows} | {bf16:.2f} | {torch_ms:.2f} | {c_ms:.2f} | {floor:.2f} | {bf16 / c_ms:.2f}x |")

    print("\nThe MLP (gate/up, SiLU * up, down), ms per call, mean of", args.repeat, "\n")
    print("| rows | bf16 | int8, layer by layer | int8, the middle in one C pass | bf16 / one pass |")
    print("|---|---|---|---|---|")
    for rows in args.rows:
        x = torch.randn(rows, hidden, generator=gen).bfloat16()

        def layer_by_layer() -> torch.Tensor:
            gate_up = linear_int8(x, mlp_int8_layers.gate_up_proj.weight, mlp_int8_layers.gate_up_proj.weight_scale, None)
            act = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
            return linear_int8(act, mlp_int8_layers.down_proj.weight, mlp_int8_layers.down_proj.weight_scale, None)

        bf16 = per_call_ms(lambda: mlp(x), args.repeat)
        by_layer = per_call_ms(layer_by_layer, args.repeat)
        one = per_call_ms(lambda: mlp_int8(x, mlp_int8_layers.gate_up_proj, mlp_int8_layers.down_proj),
                          args.repeat) if rows > 8 else float("nan")
        print(f"| {rows} | {bf16:.2f} | {by_layer:.2f} | {one:.2f} | {bf16 / one:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
