"""Does the adaptive controller (TAC, proxy/control/tac.py) serve more requests within their targets than fixed
settings?
(issue 14's controller check)

    .venv/bin/python -m bench.tac_goodput --result-dir results/tac

One cluster per arm, as ``tessera up`` starts it (one prefill and one decode worker time-sharing the cores, the
embedded model in ``--dtype``), each with the same targets and the same early rejection (``ttft_slo_ms``,
``tpot_slo_ms``, ``early_rejection``): TAC on, the defaults, and the fixed settings named in ``ARMS``. Each arm
runs the same schedule with ``tessera bench``: Poisson arrivals at 0.5x, 1x, 2x and 3x the measured capacity
with ``--input-len`` prompts, then the prompts shift to ``--shift-input-len`` tokens at ``--shift-rates`` x
capacity (``--shift-duration-s`` a point); before its first point, ``--warm-up-s`` at 0.5x, not counted. Every point draws fresh prompts (its own seed) and counts goodput: requests that met both targets,
per second (``--goodput ttft:.. tpot:..``). The capacity is measured first, on a defaults cluster: the request
rate a closed loop of ``--probe-concurrency`` clients sustains (or given with ``--capacity``).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common.cli.local_cluster import LocalCluster
from common.storage.model_store import EMBEDDED_MODEL, resolve_model

# name -> (proxy settings, role settings); every arm also gets the targets and early rejection
ARMS: dict[str, tuple[list[str], list[str]]] = {
    "tac": (["slo.tac_enabled=true"], []),
    "defaults": ([], []),
    "cap-always": (["slo.tpot_slo_scope=always"], []),
    "cap-always+chunk-512": (["slo.tpot_slo_scope=always"], ["prefill:engine.max_num_batched_tokens=512"]),
    "cap-always+local-512": (["slo.tpot_slo_scope=always", "local_prefill_threshold=512"], []),
}
DEFAULT_ARMS = "tac,defaults,cap-always,cap-always+chunk-512"


def bench(url: str, args, *, input_len: int, rate: float | str, seed: int, duration_s: float, result_dir: Path,
          label: str, concurrency: int | None = None) -> dict:
    """One ``tessera bench`` point; its result."""
    count = max(int((rate if isinstance(rate, float) else 10.0) * duration_s * 1.5), 16)
    cmd = [sys.executable, "-m", "common.cli.main", "bench", "--base-url", url, "--input-len", str(input_len),
           "--output-len", str(args.output_len), "--request-rate", str(rate), "--num-prompts", str(count),
           "--max-duration", str(duration_s), "--seed", str(seed), "--warmup-requests", "0",
           "--goodput", f"ttft:{args.ttft_ms:g}", f"tpot:{args.tpot_ms:g}", "--request-timeout", "120",
           "--result-dir", str(result_dir), "--label", label, "--no-plots", "--no-progress"]
    if concurrency:
        cmd += ["--max-concurrency", str(concurrency)]
    done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    path = result_dir / "result.json"
    if not path.exists():  # the point did not run to its end (every request failed, say): no goodput to count
        print(f"{label}: tessera bench exited {done.returncode}: {done.stderr.strip()[-500:]}", file=sys.stderr)
        return {"request_goodput": 0.0, "error": done.stderr.strip()[-500:]}
    result = json.loads(path.read_text())
    return result["points"][0]


def start(args, name: str, proxy: list[str], roles: list[str], log_root: Path) -> LocalCluster:
    targets = [f"slo.ttft_slo_ms={args.ttft_ms:g}", f"slo.tpot_slo_ms={args.tpot_ms:g}", "slo.early_rejection=true"]
    (log_root / name).mkdir(parents=True, exist_ok=True)
    return LocalCluster(str(resolve_model(EMBEDDED_MODEL, args.dtype)), log_root / name, dtype=args.dtype, threads=0,
                        transfer_backend="auto", own_session=True, proxy_overrides=[*targets, *proxy],
                        role_overrides=roles).start()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--arms", default=DEFAULT_ARMS, help=f"arms to run, of {', '.join(ARMS)}")
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--shift-input-len", type=int, default=2048)
    parser.add_argument("--rates", default="0.5,1,2,3", help="the ramp, in multiples of the capacity")
    parser.add_argument("--shift-rates", default="0.05,0.1,0.2",
                        help="after the shift, in multiples of the capacity at --input-len (on 2 cores, 2,048-token "
                        "prompts saturate at about 0.1x)")
    parser.add_argument("--shift-duration-s", type=float, default=90.0,
                        help="seconds per point after the shift (at 0.1x, 40 s is a dozen requests)")
    parser.add_argument("--ttft-ms", type=float, default=3000.0,
                        help="the TTFT target: one 2,048-token prompt alone takes 1.5-2 s on 2 shared cores")
    parser.add_argument("--tpot-ms", type=float, default=50.0)
    parser.add_argument("--duration-s", type=float, default=40.0, help="seconds per point")
    parser.add_argument("--warm-up-s", type=float, default=20.0,
                        help="before an arm's first point, this long at 0.5x capacity, not counted (0: none): the "
                        "first requests on a fresh cluster run 2-3x slower, and the arm that runs first in the "
                        "run started on a colder machine than the others")
    parser.add_argument("--capacity", type=float, help="requests/s at --input-len; default: measure it")
    parser.add_argument("--probe-concurrency", type=int, default=32)
    parser.add_argument("--seed", type=int, default=41000)
    parser.add_argument("--result-dir", type=Path, required=True)
    args = parser.parse_args(argv)
    args.result_dir.mkdir(parents=True, exist_ok=True)
    log_root = Path(tempfile.mkdtemp(prefix="tac-goodput-"))
    capacity = args.capacity
    if capacity is None:
        cluster = start(args, "probe", [], [], log_root)
        try:
            probe = bench(cluster.url, args, input_len=args.input_len, rate="inf", seed=args.seed - 1,
                          duration_s=args.duration_s, result_dir=args.result_dir / "probe", label="probe",
                          concurrency=args.probe_concurrency)
        finally:
            cluster.stop()
        capacity = probe["request_throughput"]
    print(json.dumps({"capacity_req_s": capacity, "logs": str(log_root)}), flush=True)
    schedule = [(args.input_len, float(m)) for m in args.rates.split(",") if m]
    schedule += [(args.shift_input_len, float(m)) for m in args.shift_rates.split(",") if m]  # "": no shift
    rows = []
    for a, name in enumerate(args.arms.split(",")):
        proxy, roles = ARMS[name]
        cluster = start(args, name, proxy, roles, log_root)
        try:
            if args.warm_up_s:
                bench(cluster.url, args, input_len=args.input_len, rate=round(0.5 * capacity, 3), seed=args.seed - 2,
                      duration_s=args.warm_up_s, result_dir=args.result_dir / f"{name}-warm-up", label="warm-up")
            for p, (input_len, multiple) in enumerate(schedule):
                label = f"{name}-{input_len}-{multiple:g}x"
                duration_s = args.duration_s if input_len == args.input_len else args.shift_duration_s
                point = bench(cluster.url, args, input_len=input_len, rate=round(multiple * capacity, 3),
                              seed=args.seed + 100 * p, duration_s=duration_s,
                              result_dir=args.result_dir / label, label=label)
                row = {"arm": name, "input_len": input_len, "multiple": multiple,
                       "rate": round(multiple * capacity, 3), **{k: point.get(k) for k in (
                           "request_goodput", "request_throughput", "completed", "failed", "output_throughput")},
                       "ttft_p50_ms": point.get("median_ttft_ms"), "tpot_p50_ms": point.get("median_tpot_ms"),
                       "failures": point.get("failures_by_kind")}
                rows.append(row)
                print(json.dumps(row), flush=True)
            time.sleep(1)
        finally:
            cluster.stop()
    (args.result_dir / "goodput.json").write_text(json.dumps({"capacity_req_s": capacity, "rows": rows}, indent=1))
    print(f"\ncapacity {capacity:.2f} req/s at {args.input_len} in / {args.output_len} out; targets TTFT "
          f"{args.ttft_ms:g} ms, TPOT {args.tpot_ms:g} ms; goodput in requests/s meeting both")
    points = [(r["input_len"], r["multiple"]) for r in rows if r["arm"] == rows[0]["arm"]]
    arms = list(dict.fromkeys(r["arm"] for r in rows))
    print("| prompt tokens | load | " + " | ".join(arms) + " |")
    print("|---|---|" + "---|" * len(arms))
    for input_len, multiple in points:
        cells = []
        for arm in arms:
            match = [r for r in rows if r["arm"] == arm and r["input_len"] == input_len and r["multiple"] == multiple]
            cells.append(f"{match[0]['request_goodput']:.2f}" if match and match[0]["request_goodput"] is not None
                         else "—")
        print(f"| {input_len} | {multiple:g}x | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
