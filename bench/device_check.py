"""The device check: issue 50's GPU proof in one command, each step in its own process under its own timeout.

    python -m bench.device_check --out DIR                                  # a CUDA machine: 1B and 8B shapes
    python -m bench.device_check --out DIR --device cpu --shapes tiny --dtype float32 --batches 1,4 \
        --prefill-len 64                                                    # the CPU mode tests/ runs

Steps (bench/device_steps.py says what each measures), in this order: machine, models, logits, throughput,
gpu_tests, pd_transfer. Each runs as ``python -m bench.device_check --step NAME`` with a timeout of its own,
clipped to what is left of ``--budget-s`` (the whole check's); a step that fails, times out or finds no time
left is recorded with its reason and the check goes on. Results land in DIR as ``device_check.json`` (every
step's record), ``device_check.md`` (the tables docs/gpu.md takes) and ``device_check.log`` (each step's output);
the random models and each step's record are kept in ``--work``. Exit status 0 when every step passed, else 1.
On the lent machine, docs/gpu.md gives the `run` command line (wheels the image lacks travel in ``.whl``).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench.device_steps import GPU_TEST_FILES, STEPS

# Each step's own limit in seconds on a GPU; the sum is over the budget on purpose, since each usually ends
# well inside its limit and the budget clips the last ones.
TIMEOUTS_S = {"machine": 40, "models": 150, "logits": 150, "throughput": 150, "gpu_tests": 150, "pd_transfer": 240}
BUDGET_S = 450  # under issue 50's 8 minutes with room for the interpreter's start and the report
MIN_STEP_S = 10  # a step is not started with less than this left
STOP_TIMEOUT_S = 30  # a killed step's process group, to be reaped


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory for device_check.json, .md and .log")
    parser.add_argument("--work", default="/tmp/tessera-device-check", help="random models and step records")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--shapes", default="1b,8b", help="random_model shapes; throughput and pd_transfer take the "
                        "last")
    parser.add_argument("--batches", default="1,32,256", help="decode batch sizes")
    parser.add_argument("--prefill-len", type=int, default=2048, help="prompt length of the prefill measures")
    parser.add_argument("--tokenizer-from", default=None, help="a model directory whose tokenizer the random "
                        "models take (default: the embedded model's; .whl/tokenizer on the lent machine)")
    parser.add_argument("--steps", default=",".join(TIMEOUTS_S), help="which steps, in their fixed order")
    parser.add_argument("--gpu-tests", default=GPU_TEST_FILES, help="the gpu_tests step's test files, comma-separated "
                        "(on a CPU their CUDA tests skip and the Triton kernel's run in its interpreter)")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S, help="the whole check's limit")
    parser.add_argument("--timeout-scale", type=float, default=1.0, help="multiplies every step's own limit")
    parser.add_argument("--step", default=None, help=argparse.SUPPRESS)  # one step, in this process
    parser.add_argument("--step-timeout", type=float, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.shapes = args.shapes.split(",")
    args.batches = [int(b) for b in args.batches.split(",")]
    unknown = set(args.steps.split(",")) - set(TIMEOUTS_S)
    if unknown:
        parser.error(f"--steps: unknown {sorted(unknown)}; the steps are {', '.join(TIMEOUTS_S)}")
    return args


def run_step(args: argparse.Namespace) -> None:
    """This process is one step: its record (ok, seconds, result or error) goes to WORK/STEP.json."""
    started = time.monotonic()
    try:
        record = {"ok": True, "result": STEPS[args.step](args)}
    except Exception as exc:  # recorded, not raised: the check goes on to its next step
        import traceback

        record = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    record["seconds"] = time.monotonic() - started
    (Path(args.work) / f"{args.step}.json").write_text(json.dumps(record, indent=2, default=str) + "\n")


def run_check(args: argparse.Namespace, argv: list[str]) -> dict:
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.budget_s
    chosen = args.steps.split(",")
    records = {}
    with open(out / "device_check.log", "w") as log:
        for name in (n for n in TIMEOUTS_S if n in chosen):
            (work / f"{name}.json").unlink(missing_ok=True)
            limit = min(TIMEOUTS_S[name] * args.timeout_scale, deadline - time.monotonic())
            if limit < MIN_STEP_S:
                records[name] = {"ok": False, "error": f"not run: {max(0.0, limit):.0f}s of --budget-s left"}
                continue
            log.write(f"==== {name} (limit {limit:.0f}s)\n")
            log.flush()
            command = [sys.executable, "-m", "bench.device_check", *argv, "--step", name,
                       "--step-timeout", f"{limit:.0f}"]
            started = time.monotonic()
            code = _run_group(command, log, limit)
            path = work / f"{name}.json"
            if path.is_file():
                records[name] = json.loads(path.read_text())
            elif code is None:
                records[name] = {"ok": False, "error": f"timed out after {limit:.0f}s (its limit)"}
            else:
                records[name] = {"ok": False, "error": f"exited {code} without a record (see device_check.log)"}
            records[name].setdefault("seconds", time.monotonic() - started)
            status = "ok" if records[name]["ok"] else "FAILED: " + records[name]["error"].splitlines()[0]
            print(f"{name}: {status} ({records[name]['seconds']:.1f}s)", flush=True)
    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join(["python -m bench.device_check", *argv]), "device": args.device,
              "dtype": args.dtype, "shapes": args.shapes, "steps": records}
    (out / "device_check.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    (out / "device_check.md").write_text(render_markdown(report))
    return report


def _run_group(command: list[str], log, limit: float) -> int | None:
    """``command`` in a session of its own, so that past its limit the step and every process it started (a
    pytest, a cluster's workers holding the GPU) are killed together; its exit status, or None when killed."""
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        return proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=STOP_TIMEOUT_S)
        return None


def _fmt(value, digits: int = 3) -> str:
    if isinstance(value, float):
        return f"{value:,.{digits}g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def render_markdown(report: dict) -> str:
    steps = report["steps"]
    lines = [f"Device check, {report['date']}: `{report['command']}`", ""]
    machine = steps.get("machine", {}).get("result")
    if machine:
        lines += [f"Machine: {machine.get('gpu', 'CPU')}, torch {machine['torch']}, copy "
                  f"{machine['copy_bytes_per_s'] / 1e12:.2f} TB/s (read + written), read "
                  f"{machine['read_bytes_per_s'] / 1e12:.2f} TB/s (a reduction), {machine['matmul_dtype']} "
                  f"matmul {machine['matmul_flops_per_s'] / 1e12:.1f} TFLOP/s ({machine['matmul_n']}^3).", ""]
    lines += ["| step | status | seconds |", "|---|---|---|"]
    for name, record in steps.items():
        summary = (record.get("result") or {}).get("summary") if record["ok"] else None
        status = (f"ok ({summary.split(' in ')[0]})" if summary else "ok") if record["ok"] else \
            "failed: " + record["error"].splitlines()[0].replace("|", "/")[:150]
        lines.append(f"| {name} | {status} | {record.get('seconds', 0):.1f} |")
    logits = steps.get("logits", {}).get("result")
    if logits:
        lines += ["", "| shape | positions | transformers disagrees | all near-ties | max logprob diff |",
                  "|---|---|---|---|---|"]
        for shape, r in logits.items():
            lines.append(f"| {shape} | {r['positions']} | {r['transformers_disagrees']} | {r['all_near_ties']} | "
                         f"{_fmt(r['max_logprob_difference'])} |")
    thr = steps.get("throughput", {}).get("result")
    if thr:
        lines += ["", f"Throughput, {thr['shape']} shape, attention {thr['attention_backend']}; CUDA graphs: "
                  f"{thr['cuda_graphs']}; steps overlapped: {thr.get('overlap_steps')}.", "",
                  "| batch | engine TPOT ms | engine tok/s | steps run ahead | transformers generate tok/s |",
                  "|---|---|---|---|---|"]
        hf = {r["batch"]: r["tokens_per_s"] for r in thr["transformers"]} if isinstance(thr.get("transformers"),
                                                                                        list) else {}
        def ahead(row) -> str:
            return f"{row['steps_ahead']} of {row['steps']}" if "steps_ahead" in row else "-"
        for label, rows in (("", thr["decode"]), (", steps not overlapped", thr.get("decode_serial", [])),
                            (", graphs off", thr.get("decode_eager", []))):
            for row in rows:
                lines.append(f"| {row['batch']}{label} | {_fmt(row['tpot_ms'])} | {_fmt(row['tokens_per_s'])} | "
                             f"{ahead(row)} | {_fmt(hf.get(row['batch'], '-'))} |")
        if thr.get("step_phases"):
            labels = list(thr["step_phases"][0]["ms_per_step"])
            lines += ["", "Where a decode step's time goes, ms per step (`launch` holds `host_step`; `finish` waits "
                      "for the device's logits):",
                      "", "| batch | TPOT ms | " + " | ".join(labels) + " |", "|---" * (len(labels) + 2) + "|"]
            for row in thr["step_phases"]:
                lines.append(f"| {row['batch']} | {_fmt(row['tpot_ms'])} | "
                             + " | ".join(_fmt(row["ms_per_step"][k]) for k in labels) + " |")
        p = thr["prefill"]
        lines += ["", f"Prefill: {p['prompts']} prompts of {p['length']} tokens, {_fmt(p['tokens_per_s'])} tok/s, "
                  f"{_fmt(p['tflops'])} TFLOP/s."]
        roof = thr.get("roofline")
        if roof:
            lines.append(f"Roofline: batch-1 TPOT floor {_fmt(roof['batch1_tpot_floor_ms'])} ms (weights over read "
                         f"bandwidth); measured/floor {_fmt(roof['batch1_tpot_over_floor'])}; prefill at "
                         f"{100 * roof['prefill_share_of_matmul_rate']:.1f}% of the measured matmul rate.")
        prof = thr.get("prefill_profile")
        if prof:
            lines += ["", f"Prefill of one prompt under the profiler: {_fmt(prof['wall_ms'])} ms wall, the device busy "
                      f"{_fmt(prof['device_busy_ms'])} ms.", "", "| most device time (own) | ms | calls | "
                      "most host time (own) | ms | calls |", "|---|---|---|---|---|---|"]
            for d, h in zip(prof["device"], prof["host"]):
                lines.append(f"| {d['name'].replace('|', '/')} | {_fmt(d['ms'])} | {d['calls']} | "
                             f"{h['name'].replace('|', '/')} | {_fmt(h['ms'])} | {h['calls']} |")
        for prof in thr.get("decode_profiles", []):
            if "error" in prof:
                lines += ["", f"Decode at batch {prof['batch']} under the profiler: failed: {prof['error'][:200]}"]
                continue
            lines += ["", f"Decode at batch {prof['batch']} under the profiler, per step: {_fmt(prof['wall_ms'])} ms "
                      f"wall, the device busy {_fmt(prof['device_busy_ms'])} ms.", "",
                      "| most device time (own) | ms | calls | most host time (own) | ms | calls |",
                      "|---|---|---|---|---|---|"]
            for d, h in zip(prof["device"], prof["host"]):
                lines.append(f"| {d['name'].replace('|', '/')} | {_fmt(d['ms'])} | {_fmt(d['calls'])} | "
                             f"{h['name'].replace('|', '/')} | {_fmt(h['ms'])} | {_fmt(h['calls'])} |")
        if "engine_over_transformers_best" in thr:
            lines += ["", f"Engine at batch {thr['decode'][-1]['batch']} over transformers' best batch: "
                         f"{_fmt(thr['engine_over_transformers_best'])}x."]
    for backend, pd in (steps.get("pd_transfer", {}).get("result") or {}).items():
        if "error" in pd:
            lines += ["", f"P/D on one device ({backend}): failed: {pd['error'].splitlines()[0][:200]}"]
            continue
        share = pd.get("transfer_share_of_ttft")
        path = "CUDA IPC" if pd.get("cuda_ipc_taken") else "the backend's own path"
        lines += ["", f"P/D on one device ({backend}; KV over {path}), {pd['prompt_length']}-token prompts: TTFT mean "
                  f"{_fmt(1000 * pd['ttft_mean_s'])} ms, second token {_fmt(1000 * pd['second_token_median_s'])} ms "
                  f"(median), KV per request {_fmt(pd['kv_bytes_per_request'] / 2**20)} MiB, pull "
                  f"{_fmt(pd['kv_pull_gb_per_s'])} GB/s, share of TTFT "
                  f"{'-' if share is None else f'{100 * share:.1f}%'}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.step is not None:
        run_step(args)
        return
    report = run_check(args, argv)
    sys.exit(0 if all(r["ok"] for r in report["steps"].values()) else 1)


if __name__ == "__main__":
    main()
