"""``tessera bench compare A.json B.json``: two results side by side, with B/A ratios.

Either file may be a run (``result.json``, several points) or a single point
file, ours or one written by ``vllm bench serve``. Points are paired by their
label (``rate=2``, ``rate=inf,concurrency=8``) when both files have the same
labels, otherwise in order. A ratio above 1 means B has more of it: better
for throughputs, worse for latencies. ``--plot PNG`` draws the first paired
points' per-tenant service side by side (runs with two tenants or more).
"""
from __future__ import annotations

import argparse
from pathlib import Path

from bench.loadgen.results import load_points

METRICS = (
    "completed", "failed", "duration",
    "request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
    "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
    "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms",
    "mean_itl_ms", "median_itl_ms", "p99_itl_ms",
    "mean_e2el_ms", "median_e2el_ms", "p99_e2el_ms",
    "tenant_fairness_jain", "tenant_service_gap",
)


def add_compare_command(actions) -> None:
    parser = actions.add_parser(
        "compare", help="print two benchmark results side by side with B/A ratios",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("a", metavar="A.json", type=Path, help="the baseline result file")
    parser.add_argument("b", metavar="B.json", type=Path, help="the result file compared with it")
    parser.add_argument("--plot", type=Path, metavar="PNG",
                        help="draw the per-tenant service of A's and B's first points side by side")
    parser.set_defaults(handler=run_compare)


def _label(point: dict, n: int) -> str:
    return point.get("point") or f"#{n} rate={point.get('request_rate', '?')}"


def pair_points(a: list[dict], b: list[dict]) -> list[tuple[str, dict, dict]]:
    labels_a = [_label(p, n) for n, p in enumerate(a)]
    labels_b = [_label(p, n) for n, p in enumerate(b)]
    if sorted(labels_a) == sorted(labels_b):
        by_label = dict(zip(labels_b, b))
        return [(label, point, by_label[label]) for label, point in zip(labels_a, a)]
    return [(f"{la} | {lb}", pa, pb) for la, lb, pa, pb in zip(labels_a, labels_b, a, b)]


def _cell(value) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def _ratio(a, b) -> str:
    if not isinstance(a, int | float) or not isinstance(b, int | float) or a == 0:
        return "-"
    return f"{b / a:.3f}"


def compare_table(a: list[dict], b: list[dict]) -> str:
    lines = []
    for label, pa, pb in pair_points(a, b):
        lines.append(f"== {label} ==")
        lines.append(f"{'metric':<26}{'A':>14}{'B':>14}{'B/A':>9}")
        for key in METRICS:
            if key in pa or key in pb:
                va, vb = pa.get(key), pb.get(key)
                lines.append(f"{key:<26}{_cell(va):>14}{_cell(vb):>14}{_ratio(va, vb):>9}")
    if len(a) != len(b):
        lines.append(f"(A has {len(a)} points, B has {len(b)}; only the first {min(len(a), len(b))} are paired)")
    return "\n".join(lines)


def run_compare(args: argparse.Namespace) -> int:
    a, b = load_points(args.a), load_points(args.b)
    print(compare_table(a, b))
    if args.plot is not None:
        if not (a and b and len(a[0].get("tenants") or {}) > 1 and len(b[0].get("tenants") or {}) > 1):
            raise ValueError("--plot needs two runs with two tenants or more (tessera bench --tenant ...)")
        from bench.loadgen.plots import tenant_service_panels

        runs = [(_title(path, point), point) for path, point in ((args.a, a[0]), (args.b, b[0]))]
        print(f"wrote {tenant_service_panels(runs, args.plot)}")
    return 0


def _title(path: Path, point: dict) -> str:
    """The run's --label, else its directory's name, and the point."""
    name = point.get("label") if point.get("label") != point.get("point") else path.parent.name
    return f"{name}: {point.get('point')}"
