"""The terminal view of a run: a block per load point, a per-tenant table, and a table across points."""
from __future__ import annotations

from bench.loadgen.metrics import percentile_key
from bench.loadgen.ttft_parts import parts_table

LATENCIES = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E latency"))
WIDTH = 56


def _num(value, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def _row(name: str, value, digits: int = 2) -> str:
    return f"{name:<38}{_num(value, digits):>18}"


def point_block(point: dict, percentiles) -> str:
    lines = [f" {point['point']} ".center(WIDTH, "="),
             _row("Requests sent / completed / failed:",
                  f"{point['num_sent']} / {point['completed']} / {point['failed']}"),
             _row("Request rate configured (req/s):", float(point["request_rate"])),
             _row("Max concurrency:", point["max_concurrency"]),
             _row("Duration (s):", point["duration"]),
             _row("Total input / output tokens:", f"{point['total_input_tokens']} / {point['total_output_tokens']}"),
             _row("Request throughput (req/s):", point["request_throughput"]),
             _row("Output token throughput (tok/s):", point["output_throughput"]),
             _row("Total token throughput (tok/s):", point["total_token_throughput"])]
    if point["slo"]:
        slo = " ".join(f"{k}<={v:g}ms" for k, v in point["slo"].items())
        lines += [_row(f"Goodput (req/s), {slo}:", point["request_goodput"]),
                  _row("SLO attainment (%):", 100 * point["slo_attainment"] if point["slo_attainment"] is not None
                       else None)]
    for name, title in LATENCIES:
        lines.append(f" {title} (ms) ".center(WIDTH, "-"))
        lines.append(_row("mean / median:", f"{_num(point[f'mean_{name}_ms'])} / {_num(point[f'median_{name}_ms'])}"))
        lines.append(_row(" / ".join(percentile_key(p) for p in percentiles) + ":",
                          " / ".join(_num(point[f"{percentile_key(p)}_{name}_ms"]) for p in percentiles)))
    if point.get("ttft_parts"):
        lines += parts_table(point["ttft_parts"], WIDTH)
    if point["failures_by_kind"]:
        lines.append(" Failures ".center(WIDTH, "-"))
        lines += [_row(f"{kind}:", count) for kind, count in sorted(point["failures_by_kind"].items())]
    if len(point["tenants"]) > 1:
        lines.append(tenant_table(point))
    server = point.get("server_metrics")
    if server:
        lines.append(" Server /metrics ".center(WIDTH, "-"))
        if not server["available"]:
            lines.append(f"unavailable: {server['error']}")
        else:
            lines += [_row(f"peak {name}:", value) for name, value in server["peak"].items()]
            lines += [_row(f"{name} increase:", value, 0) for name, value in server["increase"].items()]
            if "spec_decode_acceptance_rate" in server:
                lines.append(_row("spec decode acceptance (%):", server["spec_decode_acceptance_rate"]))
    lines.append("=" * WIDTH)
    return "\n".join(lines)


def tenant_table(point: dict) -> str:
    header = f"{'tenant':<12}{'weight':>7}{'done':>6}{'fail':>6}{'out tok':>9}{'service/w':>11}{'mean TTFT':>11}"
    lines = [" Tenants ".center(WIDTH, "-"), header]
    for name, t in point["tenants"].items():
        lines.append(f"{name[:12]:<12}{t['weight']:>7g}{t['completed']:>6}{t['failed']:>6}{t['output_tokens']:>9}"
                     f"{t['service_per_weight']:>11.0f}{_num(t['mean_ttft_ms'], 1):>11}")
    lines.append(_row("Jain fairness (service per weight):", point["tenant_fairness_jain"], 3))
    lines.append(_row("service gap per weight (max window):", point.get("tenant_service_gap"), 0))
    return "\n".join(lines)


def sweep_table(points: list[dict]) -> str:
    """One line per point: the numbers one reads off a sweep."""
    header = (f"{'point':<26}{'req/s':>7}{'out tok/s':>10}{'goodput':>8}{'TTFT p50':>9}{'TTFT p99':>9}"
              f"{'TPOT p50':>9}{'E2E p50':>9}{'failed':>7}")
    lines = [header, "-" * len(header)]
    for p in points:
        lines.append(f"{p['point'][:26]:<26}{_num(p['request_throughput']):>7}{_num(p['output_throughput'], 1):>10}"
                     f"{_num(p['request_goodput']):>8}{_num(p['median_ttft_ms'], 0):>9}"
                     f"{_num(p.get('p99_ttft_ms'), 0):>9}{_num(p['median_tpot_ms'], 1):>9}"
                     f"{_num(p['median_e2el_ms'], 0):>9}{p['failed']:>7}")
    return "\n".join(lines)
