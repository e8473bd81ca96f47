"""The device check's steps (bench/device_check.py runs each in its own process, with its own timeout).

Each step takes the check's arguments and what earlier steps left in the work directory, and returns a dict of
what it measured; a step that raises is recorded as failed and the check goes on. Nothing here fakes a number:
a measure that cannot be taken (no CUDA graphs built, transformers missing) is recorded as such.

- ``machine``: the device, the software, and the two ceilings: memory bandwidth (a device-to-device copy,
  bytes read plus written) and the bf16 (or the check's dtype) matmul rate.
- ``models``: random-weight Llama models of the named shapes (common/storage/random_model.py), made on the spot.
- ``gpu_tests``: the tests that need CUDA (``-m gpu``) and the Triton kernel's tests.
- ``logits``: the engine against transformers on the same weights: greedy tokens, and every generated token's
  log-probability under both, transformers reading the engine's tokens (teacher forcing).
- ``throughput``: engine decode at each batch size, prefill of long prompts, transformers' ``generate`` at the
  same batch sizes, and the rooflines from ``machine``'s ceilings.
- ``pd_transfer``: a prefill and a decode worker (two processes on the one device) behind a proxy; the KV
  pull's bandwidth and its share of time to first token, from the proxy's counters.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import torch

from common.config.base import CudaGraphsConfig, StepsConfig
from common.storage.random_model import SHAPES, make_random_model

# Two log-probabilities of one token are a near-tie's difference apart when the engine and transformers sum in
# different orders: bfloat16 keeps 8 bits of mantissa, so a logit near 8 is held to 2**-4 and the two paths'
# roundings over a model's layers move it by a few such steps (docs/gpu.md, "Engine against transformers").
NEAR_TIE = 0.25
PROMPTS = 8
GENERATED = 32
DECODE_PROMPT = 64
DECODE_TOKENS = 48
PREFILL_PROMPTS = 4
CHECK_PORT_TIMEOUT_S = 300.0


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _timed(fn, device: str, repeats: int) -> float:
    """Best seconds of ``repeats`` calls after one warm-up."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        started = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - started)
    return best


def machine(args) -> dict:
    import importlib.util

    dtype = getattr(torch, args.dtype)
    out = {"torch": torch.__version__, "python": sys.version.split()[0], "device": args.device,
           "packages": {name: importlib.util.find_spec(name) is not None
                        for name in ("triton", "flash_attn", "nixl", "transformers", "zmq", "msgspec")}}
    if args.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        out.update(gpu=props.name, memory_gib=props.total_memory / 2**30, multiprocessors=props.multi_processor_count,
                   capability=f"{props.major}.{props.minor}", cuda=torch.version.cuda)
    nbytes, n = (1 << 30, 8192) if args.device == "cuda" else (64 << 20, 512)
    src = torch.randn(nbytes // 4, device=args.device)
    dst = torch.empty_like(src)
    out["copy_bytes_per_s"] = 2 * nbytes / _timed(lambda: dst.copy_(src), args.device, 10)
    # What a decode step's weights are: bytes read and not written, so a reduction's rate, not half a copy's
    out["read_bytes_per_s"] = nbytes / _timed(lambda: src.sum(), args.device, 10)
    a = torch.randn((n, n), device=args.device).to(dtype)
    b = torch.randn((n, n), device=args.device).to(dtype)
    out["matmul_flops_per_s"] = 2 * n ** 3 / _timed(lambda: a @ b, args.device, 10)
    out["matmul_dtype"], out["matmul_n"] = args.dtype, n
    return out


def models(args) -> dict:
    made = {}
    for name in args.shapes:
        started = time.monotonic()
        path = make_random_model(model_dir(args, name), SHAPES[name], args.dtype, tokenizer_from=args.tokenizer_from)
        made[name] = {"dir": str(path), "seconds": time.monotonic() - started,
                      "parameters": SHAPES[name].parameter_count(),
                      "weight_bytes": SHAPES[name].weight_bytes(args.dtype)}
    return made


def model_dir(args, shape: str) -> Path:
    return Path(args.work) / "models" / f"random-{shape}-{args.dtype}"


GPU_TEST_FILES = ("tests/unit/test_triton_attention.py,tests/unit/test_gpu_path.py,tests/unit/test_kv_transfer.py,"
                  "tests/unit/test_cuda_graphs.py,"
                  "tests/e2e/test_kv_transfer_processes.py::test_gpu_pools_on_one_host_copy_over_cuda_ipc")


def gpu_tests(args) -> dict:
    files = args.gpu_tests.split(",")
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", *files]
    # The embedded model is prepared from a package, which the lent machine cannot download: the tests' tiny chat
    # model takes the tokenizer the random models take.
    env = dict(os.environ, **({"TESSERA_TEST_TOKENIZER": str(args.tokenizer_from)} if args.tokenizer_from else {}))
    done = subprocess.run(command, capture_output=True, text=True, timeout=args.step_timeout, env=env)
    lines = (done.stdout + done.stderr).strip().splitlines()
    summary = lines[-1] if lines else ""
    if done.returncode not in (0, 5):
        raise RuntimeError(f"pytest exited {done.returncode}: {summary}\n" + "\n".join(lines[-40:]))
    return {"command": " ".join(command[1:]), "summary": summary}


def engine(args, shape: str, **settings):
    from common.config.base import EngineConfig
    from common.engine.llm_engine import LLMEngine
    from common.runtime.model_swap import freeze_heap

    kv_bytes = (16 << 30) if args.device == "cuda" else (64 << 20)
    config = EngineConfig(model=str(model_dir(args, shape)), dtype=args.dtype, device=args.device,
                          kv_cache_memory_bytes=kv_bytes, max_num_seqs=max(args.batches),
                          steps=StepsConfig(calibration_s=0.0),
                          max_num_batched_tokens=max(8192, args.prefill_len), **settings)
    built = LLMEngine(config)
    freeze_heap()  # as a worker does once its model is loaded; _release thaws it
    return built


def _release(args) -> None:
    """Give the device memory of a dropped engine or model back before the next one loads."""
    from common.runtime.model_swap import thaw_heap

    thaw_heap()
    if args.device == "cuda":
        torch.cuda.empty_cache()


def _prompts(engine_, count: int, length: int, seed: int) -> list[list[int]]:
    allowed = engine_.tokenizer.ordinary_token_ids()
    rng = random.Random(seed)
    return [rng.choices(allowed, k=length) for _ in range(count)]


def _transformers_model(args, shape: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir(args, shape)), dtype=getattr(torch, args.dtype))
    return model.to(args.device).eval()


def logits(args) -> dict:
    from common.protocol.sampling_params import SamplingParams

    results = {}
    for shape in args.shapes:
        eng = engine(args, shape)
        prompts = [p[:16 + 6 * i] for i, p in enumerate(_prompts(eng, PROMPTS, 16 + 6 * PROMPTS, seed=1))]
        params = SamplingParams(temperature=0.0, max_tokens=GENERATED, ignore_eos=True, logprobs=0)
        outs = [o.outputs[0] for o in eng.generate(prompts, params)]
        eng.runner.close()
        del eng
        _release(args)
        hf = _transformers_model(args, shape)
        mismatches, worst_logprob, ties = 0, 0.0, []
        with torch.inference_mode():
            for prompt, out in zip(prompts, outs):
                ids = torch.tensor([prompt + out.token_ids], device=args.device)
                logp = torch.log_softmax(hf(ids).logits[0, len(prompt) - 1:-1].float(), dim=-1)
                chosen = torch.tensor(out.token_ids, device=args.device)
                theirs = logp.gather(1, chosen[:, None])[:, 0]
                worst_logprob = max(worst_logprob, (theirs.cpu() - torch.tensor(out.logprobs)).abs().max().item())
                best = logp.max(-1)
                for pos in (best.indices != chosen).nonzero().flatten().tolist():
                    mismatches += 1
                    ties.append(round((best.values[pos] - theirs[pos]).item(), 4))
        del hf
        _release(args)
        results[shape] = {
            "prompts": len(prompts), "tokens_each": GENERATED, "positions": len(prompts) * GENERATED,
            "transformers_disagrees": mismatches,
            "disagreement_margins": ties,  # transformers' top log-prob minus the engine's token's, per disagreement
            "all_near_ties": all(t <= NEAR_TIE for t in ties), "near_tie": NEAR_TIE,
            "max_logprob_difference": worst_logprob,
            "greedy_equal": mismatches == 0,
        }
    return results


def _decode_rate(eng, prompts: list[list[int]], tokens: int) -> dict:
    """Engine decode at ``len(prompts)`` rows: prompts first (untimed), then ``tokens - 1`` timed steps."""
    from common.protocol.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        eng.add_request(f"d{len(prompts)}-{i}", prompt, params)
    while any(len(s.output_token_ids) == 0 for s in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()
    _sync(str(eng.runner.device))
    started, steps, before = time.perf_counter(), 0, eng.stats.num_generated_tokens
    ahead = eng.stats.num_steps_ahead
    while eng.has_unfinished():
        eng.step()
        steps += 1
    _sync(str(eng.runner.device))
    seconds = time.perf_counter() - started
    generated = eng.stats.num_generated_tokens - before
    return {"batch": len(prompts), "steps": steps, "tpot_ms": 1000 * seconds / steps,
            "tokens_per_s": generated / seconds, "steps_ahead": eng.stats.num_steps_ahead - ahead}


def _step_phases(eng, prompts: list[list[int]], tokens: int) -> dict:
    """Where a decode step's time goes at ``len(prompts)`` rows: milliseconds per step in each of the step's calls
    (host work; ``launch`` holds ``host_step``, and ``finish`` waits for the device's logits), over ``tokens - 1``
    steps."""
    import functools
    from collections import Counter

    spent: Counter = Counter()
    calls = {"schedule": (eng.scheduler, "schedule"), "host_step": (eng.runner, "host_step"),
             "launch": (eng.runner, "launch"), "finish": (eng.runner, "finish"), "update": (eng.scheduler, "update"),
             "run_ahead": (eng.scheduler, "run_ahead"), "settle": (eng.scheduler, "settle"),
             "detokenize": (eng.output_processor, "process"), "outputs": (eng, "_collect_outputs")}

    def timed(label, fn):
        @functools.wraps(fn)
        def call(*a, **k):
            started = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[label] += time.perf_counter() - started
        return call
    for label, (owner, name) in calls.items():
        setattr(owner, name, timed(label, getattr(owner, name)))
    from common.protocol.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    try:
        for i, prompt in enumerate(prompts):
            eng.add_request(f"phases{len(prompts)}-{i}", prompt, params)
        while any(len(s.output_token_ids) == 0 for s in eng.scheduler.running) or eng.scheduler.waiting:
            eng.step()
        _sync(str(eng.runner.device))
        spent.clear()
        started, steps = time.perf_counter(), 0
        while eng.has_unfinished():
            eng.step()
            steps += 1
        _sync(str(eng.runner.device))
        seconds = time.perf_counter() - started
    finally:
        for owner, name in calls.values():
            vars(owner).pop(name, None)
    return {"batch": len(prompts), "tpot_ms": 1000 * seconds / steps,
            "ms_per_step": {label: 1000 * spent[label] / steps for label in calls}}


def _prefill_rate(eng, prompts: list[list[int]]) -> dict:
    from common.protocol.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    _sync(str(eng.runner.device))
    started = time.perf_counter()
    eng.generate(prompts, params)
    _sync(str(eng.runner.device))
    seconds = time.perf_counter() - started
    return {"prompts": len(prompts), "length": len(prompts[0]), "seconds": seconds,
            "tokens_per_s": len(prompts) * len(prompts[0]) / seconds}


def _transformers_generate(args, shape: str, prompts_by_batch: dict[int, list[list[int]]]) -> list[dict]:
    hf = _transformers_model(args, shape)
    rows = []
    with torch.inference_mode():
        for batch, prompts in prompts_by_batch.items():
            ids = torch.tensor(prompts, device=args.device)

            def generate():
                hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=DECODE_TOKENS,
                            min_new_tokens=DECODE_TOKENS, do_sample=False, pad_token_id=0)
            seconds = _timed(generate, args.device, 1)
            rows.append({"batch": batch, "seconds": seconds, "tokens_per_s": batch * DECODE_TOKENS / seconds})
    return rows


def _graphs_line(eng) -> str:
    graphs = eng.runner.graphs
    if graphs is None:
        return "off: decode steps run eagerly"
    return f"on, {len(graphs.ladder)} rungs of 1 to {graphs.max_rows} rows"


def _profiled(eng, run, top: int = 10) -> dict:
    """``run()`` under torch's profiler: its wall time, the device's busy time, the kernels that took the most
    device time and the operations that took the most host time (their own)."""
    from torch.profiler import ProfilerActivity, profile

    on_gpu = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profile(activities=activities) as prof:
        started = time.perf_counter()
        run()
        _sync(str(eng.runner.device))
        wall = time.perf_counter() - started
    events = prof.key_averages()
    device = "self_device_time_total" if on_gpu else "self_cpu_time_total"

    def rows(attr: str) -> list[dict]:
        ranked = sorted(events, key=lambda e: getattr(e, attr, 0), reverse=True)[:top]
        return [{"name": e.key[:90], "ms": getattr(e, attr, 0) / 1000, "calls": e.count} for e in ranked]
    return {"wall_ms": 1000 * wall, "device_busy_ms": sum(getattr(e, device, 0) for e in events) / 1000,
            "device": rows(device), "host": rows("self_cpu_time_total")}


def _prefill_profile(eng, prompt: list[int]) -> dict:
    """One prompt's prefill under the profiler."""
    from common.protocol.sampling_params import SamplingParams

    return _profiled(eng, lambda: eng.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1,
                                                                        ignore_eos=True)))


def _decode_profile(eng, prompts: list[list[int]], steps: int) -> dict:
    """``steps`` decode steps at ``len(prompts)`` rows under the profiler (prompts first, not profiled); per step."""
    from common.protocol.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        eng.add_request(f"profile{len(prompts)}-{i}", prompt, params)
    while any(len(s.output_token_ids) == 0 for s in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()

    def decode():
        while eng.has_unfinished():
            eng.step()
    result = _profiled(eng, decode)
    for key in ("wall_ms", "device_busy_ms"):
        result[key] /= steps
    for row in result["device"] + result["host"]:
        row["ms"] /= steps
        row["calls"] /= steps
    return {"batch": len(prompts), "per_step": True, **result}


def throughput(args) -> dict:
    shape = args.shapes[-1]
    ceilings = _read_step(args, "machine")
    spec = SHAPES[shape]
    eng = engine(args, shape)
    prompts = {b: _prompts(eng, b, DECODE_PROMPT, seed=b) for b in args.batches}
    _decode_rate(eng, prompts[args.batches[0]][:1], 4)  # warm-up: the kernels' first compile is not timed
    decode = [_decode_rate(eng, prompts[b], DECODE_TOKENS) for b in args.batches]
    phases = [_step_phases(eng, _prompts(eng, b, DECODE_PROMPT, seed=200 + b), DECODE_TOKENS)
              for b in (args.batches[0], args.batches[-1])]
    overlap = eng.overlap
    eng.overlap = False  # the same points with each step run to its end before the next is planned
    serial = [_decode_rate(eng, _prompts(eng, b, DECODE_PROMPT, seed=300 + b), DECODE_TOKENS)
              for b in (args.batches[0], args.batches[-1])]
    eng.overlap = overlap
    # warm-up at this step's shape (the allocator's blocks, the matmuls' first calls), on prompts of its own
    _prefill_rate(eng, _prompts(eng, PREFILL_PROMPTS, args.prefill_len, seed=6))
    prefill = _prefill_rate(eng, _prompts(eng, PREFILL_PROMPTS, args.prefill_len, seed=7))
    profile_rows = _prefill_profile(eng, _prompts(eng, 1, args.prefill_len, seed=8)[0])
    decode_profiles = []
    for batch in (args.batches[0], args.batches[-1]):
        try:
            decode_profiles.append(_decode_profile(eng, _prompts(eng, batch, DECODE_PROMPT, seed=400 + batch), 16))
        except Exception as exc:  # the profiler's trouble is recorded, not the step's failure
            decode_profiles.append({"batch": batch, "error": f"{type(exc).__name__}: {exc}"})
    attention, graphs = eng.runner.attention.name, _graphs_line(eng)
    eng.runner.close()
    del eng
    _release(args)
    result = {"shape": shape, "attention_backend": attention, "overlap_steps": overlap, "decode": decode,
              "decode_serial": serial, "step_phases": phases,
              "prefill": prefill,
              "cuda_graphs": graphs, "prefill_profile": profile_rows, "decode_profiles": decode_profiles}
    if args.device == "cuda":  # the same decode points eagerly, on prompts of their own
        eng = engine(args, shape, cuda_graphs=CudaGraphsConfig(enabled=False))
        eager = {b: _prompts(eng, b, DECODE_PROMPT, seed=100 + b) for b in args.batches[:2]}
        _decode_rate(eng, eager[args.batches[0]][:1], 4)
        result["decode_eager"] = [_decode_rate(eng, eager[b], DECODE_TOKENS) for b in eager]
        eng.runner.close()
        del eng
        _release(args)
    weight_bytes = spec.weight_bytes(args.dtype)
    hidden, layers, n = spec.hidden_size, spec.num_hidden_layers, args.prefill_len
    # Matmul FLOPs of a prompt token (every weight but the embedding's lookup) plus causal attention's two
    # products (on average n/2 keys per query), per token; the LM head runs on the last row only.
    flops_per_token = 2 * (spec.parameter_count() - spec.vocab_size * hidden) + 4 * layers * hidden * n / 2
    result["prefill"]["tflops"] = flops_per_token * prefill["tokens_per_s"] / 1e12
    if ceilings:
        read = ceilings["read_bytes_per_s"]
        floor_s = weight_bytes / read
        result["roofline"] = {
            "weight_bytes": weight_bytes, "read_bytes_per_s": read,
            "batch1_tpot_floor_ms": 1000 * floor_s,
            "batch1_tpot_over_floor": decode[0]["tpot_ms"] / (1000 * floor_s),
            **({"batch1_eager_tpot_over_floor": result["decode_eager"][0]["tpot_ms"] / (1000 * floor_s)}
               if "decode_eager" in result else {}),
            "matmul_flops_per_s": ceilings["matmul_flops_per_s"],
            "prefill_share_of_matmul_rate": 1e12 * result["prefill"]["tflops"] / ceilings["matmul_flops_per_s"],
        }
    try:
        result["transformers"] = _transformers_generate(args, shape, prompts)
    except ImportError as exc:
        result["transformers"] = f"not measured: {exc}"
        return result
    best = max(row["tokens_per_s"] for row in result["transformers"])
    result["engine_over_transformers_best"] = decode[-1]["tokens_per_s"] / best
    return result


IPC_LOG_LINE = "CUDA IPC, GPU to GPU on this host"  # the decode worker's, for a peer it maps (kv_transfer/cuda_ipc.py)


def _pd_transfer(args, backend: str, cuda_ipc: bool) -> dict:
    import httpx

    from bench.disagg_ttft import summarize, transfer_counters, warm_then_timed
    from common.cli.local_cluster import LocalCluster

    shape = args.shapes[-1]
    kv_bytes = (8 << 30) if args.device == "cuda" else (64 << 20)
    logs = Path(args.work) / "pd-logs" / f"{backend}{'' if cuda_ipc else '-no-ipc'}"
    logs.mkdir(parents=True, exist_ok=True)
    cluster = LocalCluster.for_tests(
        model_dir(args, shape), logs, prefill=1, decode=1, transfer_backend=backend,
        worker_overrides=[f"engine.device={args.device}", f"engine.dtype={args.dtype}",
                          f"engine.kv_cache_memory_bytes={kv_bytes}",
                          f"engine.max_num_batched_tokens={max(2048, args.prefill_len)}",
                          f"transfer.cuda_ipc={str(cuda_ipc).lower()}"],
    ).start()
    try:
        with httpx.Client(timeout=CHECK_PORT_TIMEOUT_S) as client:
            rng = random.Random(3)
            prompts = [[rng.randrange(1000, 20000) for _ in range(args.prefill_len)] for _ in range(4)]
            summary = warm_then_timed(client, cluster, prompts, transfer_counters, summarize)
    finally:
        exit_codes = cluster.stop()
    summary.pop("samples")
    if summary["kv_pull_mean_s"] is not None:
        summary["transfer_share_of_ttft"] = summary["kv_pull_mean_s"] / summary["ttft_mean_s"]
    took_ipc = any(IPC_LOG_LINE in path.read_text(errors="replace") for path in logs.glob("*.log"))
    return {"shape": shape, "backend": backend, "cuda_ipc_setting": cuda_ipc, "cuda_ipc_taken": took_ipc,
            "prompt_length": args.prefill_len, **summary, "exit_codes": exit_codes}


def pd_transfer(args) -> dict:
    """The P/D pair as shipped (``transfer.cuda_ipc`` on: GPU pools on one host copy over CUDA IPC) over each backend
    this machine has (NIXL where it imports, ZeroMQ always), then over each with CUDA IPC off (NIXL's own GPU read;
    ZeroMQ through host memory). A run that fails is recorded and the next one still runs."""
    from kv_transfer.factory import default_backend_name

    results = {}
    backends = list(dict.fromkeys([default_backend_name(), "zmq"]))
    runs = [(b, True) for b in backends] + ([(b, False) for b in backends] if args.device == "cuda" else [])
    for backend, cuda_ipc in runs:
        key = backend if cuda_ipc else f"{backend}, no CUDA IPC"
        try:
            results[key] = _pd_transfer(args, backend, cuda_ipc)
        except Exception as exc:
            results[key] = {"error": f"{type(exc).__name__}: {exc}"}
    if all("error" in r for r in results.values()):
        raise RuntimeError("; ".join(f"{b}: {r['error']}" for b, r in results.items()))
    return results


def _read_step(args, name: str) -> dict | None:
    path = Path(args.work) / f"{name}.json"
    if not path.is_file():
        return None
    record = json.loads(path.read_text())
    return record.get("result") if record.get("ok") else None


STEPS = {"machine": machine, "models": models, "gpu_tests": gpu_tests, "logits": logits,
         "throughput": throughput, "pd_transfer": pd_transfer}
