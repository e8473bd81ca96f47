"""PNG pictures of a run, drawn with matplotlib (the ``bench`` extra) without a display.

- ``latency_cdf.png``: the cumulative distribution of TTFT, TPOT, ITL and
  E2E latency, one line per load point;
- ``sweep.png`` (two points or more): request throughput and goodput, output
  token throughput, and TTFT/TPOT percentiles against the swept rate or
  concurrency;
- ``tenant_service-NN.png`` (two tenants or more): each tenant's cumulative
  weighted tokens served over the point, divided by its weight, so that fair
  service shows as lines that rise together;
- ``tenant_service_panels`` (``tessera bench compare --plot``): the same for
  several runs side by side on one scale, e.g. ``fcfs`` against ``vtc``.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

CDF_PANELS = (("ttfts", "TTFT"), ("tpots", "TPOT"), ("itls", "ITL"), ("latencies", "E2E latency"))


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _samples_ms(point: dict, key: str) -> np.ndarray:
    if key == "tpots":
        triples = zip(point["latencies"], point["ttfts"], point["output_lens"])
        values = [(e2e - ttft) / (n - 1) for e2e, ttft, n in triples if e2e is not None and n > 1]
    elif key == "itls":
        values = [gap for gaps in point["itls"] for gap in gaps]
    else:
        values = [v for v in point[key] if v is not None]
    return np.sort(np.asarray(values, dtype=float)) * 1000


def latency_cdf(points: list[dict], path: Path) -> Path:
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (key, title) in zip(axes.flat, CDF_PANELS):
        for point in points:
            samples = _samples_ms(point, key)
            if samples.size:
                ax.plot(samples, np.arange(1, samples.size + 1) / samples.size, label=point["point"])
        ax.set(title=title, xlabel="ms (log scale)", ylabel="fraction of samples", ylim=(0, 1.02), xscale="log")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def sweep_axis(points: list[dict]) -> tuple[str, list[float]]:
    rates = [p["request_rate"] for p in points]
    if len(set(rates)) > 1 and all(math.isfinite(r) for r in rates):
        return "request rate (req/s)", rates
    return "max concurrency", [p["max_concurrency"] or 0 for p in points]


def sweep(points: list[dict], path: Path) -> Path:
    plt = _pyplot()
    name, xs = sweep_axis(points)
    order = np.argsort(xs, kind="stable")
    ordered = [points[i] for i in order]
    x = [xs[i] for i in order]
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(14, 4))
    left.plot(x, [p["request_throughput"] for p in ordered], "o-", label="throughput")
    if ordered[0]["request_goodput"] is not None:
        left.plot(x, [p["request_goodput"] for p in ordered], "s--", label="goodput")
    left.set(title="requests", xlabel=name, ylabel="req/s")
    left.legend()
    middle.plot(x, [p["output_throughput"] for p in ordered], "o-")
    middle.set(title="output tokens", xlabel=name, ylabel="tok/s")
    for key, label, style in (("median_ttft_ms", "TTFT p50", "o-"), ("p99_ttft_ms", "TTFT p99", "o--"),
                              ("median_tpot_ms", "TPOT p50", "s-")):
        if key in ordered[0]:
            right.plot(x, [p[key] if p[key] is not None else np.nan for p in ordered], style, label=label)
    right.set(title="latency", xlabel=name, ylabel="ms", yscale="log")
    right.legend()
    for ax in (left, middle, right):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _service_axes(ax, point: dict, title: str) -> None:
    service = point["tenant_service"]
    for name, series in service["series"].items():
        weight = point["tenants"][name]["weight"]
        ax.plot(service["times_s"], np.asarray(series) / weight, label=f"{name} (weight {weight:g})")
    ax.set(title=title, xlabel="time since the first request (s)", ylabel="weighted tokens / weight")
    ax.grid(alpha=0.3)
    ax.legend()


def tenant_service(point: dict, path: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    _service_axes(ax, point, f"service per unit weight, {point['point']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def tenant_service_panels(runs: list[tuple[str, dict]], path: Path) -> Path:
    """One panel per (title, point) with tenants, side by side on a shared y axis."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(runs), figsize=(6 * len(runs), 4), sharey=True, squeeze=False)
    for ax, (title, point) in zip(axes[0], runs):
        _service_axes(ax, point, title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(points: list[dict], result_dir: Path) -> list[Path]:
    result_dir.mkdir(parents=True, exist_ok=True)
    paths = [latency_cdf(points, result_dir / "latency_cdf.png")]
    if len(points) > 1:
        paths.append(sweep(points, result_dir / "sweep.png"))
    for n, point in enumerate(points):
        if len(point["tenants"]) > 1:
            paths.append(tenant_service(point, result_dir / f"tenant_service-{n:02d}.png"))
    return paths
