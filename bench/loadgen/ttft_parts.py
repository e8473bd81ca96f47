"""Where a load point's time to first token went, as a Tessera proxy measured it: its parts histograms, read from
``/metrics`` before and after the point and diffed.

- TTFT parts (``tessera_proxy_time_to_first_token_part_seconds``): ``queue`` and ``prefill``, which add up to each
  split choice's TTFT (``proxy/core/first_token.py`` says what each spans, and which choices are not split).
- Handoff parts (``tessera_proxy_handoff_part_seconds``): ``decode_wait``, ``transfer`` and ``first_decode``, a
  disaggregated choice's way from its first token to its decode worker's first.

Per part: how many choices, the mean, and the median as ``histogram_quantile`` reads it off the buckets (linear
within a bucket: good to a bucket's width). Next to them the proxy's own TTFT (``tessera_proxy_time_to_first_token_
seconds``, every model) and the ratio of the parts' means added up to it, and to the client's mean TTFT (which
also holds the HTTP response's way back). Other servers, or a proxy without these families, give no parts.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

TTFT_FAMILY = "tessera_proxy_time_to_first_token_part_seconds"
HANDOFF_FAMILY = "tessera_proxy_handoff_part_seconds"
PROXY_TTFT_FAMILY = "tessera_proxy_time_to_first_token_seconds"
TTFT_PARTS = ("queue", "prefill")
HANDOFF_PARTS = ("decode_wait", "transfer", "first_decode")


@dataclass
class Histogram:
    """One series' cumulative bucket counts (by upper bound), count and sum, or a difference of two."""
    buckets: dict[float, float] = field(default_factory=dict)
    count: float = 0.0
    sum: float = 0.0

    def minus(self, earlier: Histogram) -> Histogram:
        return Histogram({le: n - earlier.buckets.get(le, 0.0) for le, n in self.buckets.items()},
                         self.count - earlier.count, self.sum - earlier.sum)

    def quantile(self, q: float) -> float | None:
        """As Prometheus' ``histogram_quantile``: linear within the bucket the rank falls in; the highest finite
        bound when it falls above every one. None without observations."""
        if self.count <= 0:
            return None
        rank, lower, below = q * self.count, 0.0, 0.0
        bounds = sorted(self.buckets)
        for upper in bounds:
            cumulative = self.buckets[upper]
            if cumulative >= rank:
                if math.isinf(upper):
                    return lower
                inside = cumulative - below
                return lower + (upper - lower) * ((rank - below) / inside if inside > 0 else 1.0)
            lower, below = upper, cumulative
        return lower


def histograms(text: str) -> dict[tuple[str, str], Histogram]:
    """(family, part) -> its histogram, for the parts families and the proxy's TTFT (part "", summed over models),
    from one scrape; a malformed line ends the scrape there."""
    found: dict[tuple[str, str], Histogram] = {}
    try:
        for family in text_string_to_metric_families(text):
            if family.name not in (TTFT_FAMILY, HANDOFF_FAMILY, PROXY_TTFT_FAMILY):
                continue
            for sample in family.samples:
                key = (family.name, sample.labels.get("part", "") if family.name != PROXY_TTFT_FAMILY else "")
                histogram = found.setdefault(key, Histogram())
                if sample.name.endswith("_bucket"):
                    le = float(sample.labels["le"])
                    histogram.buckets[le] = histogram.buckets.get(le, 0.0) + sample.value
                elif sample.name.endswith("_count"):
                    histogram.count += sample.value
                elif sample.name.endswith("_sum"):
                    histogram.sum += sample.value
    except ValueError:
        pass
    return found


def _stats(histogram: Histogram) -> dict:
    count = int(round(histogram.count))
    median = histogram.quantile(0.5)
    return {"count": count, "mean_ms": histogram.sum / histogram.count * 1e3 if count else None,
            "median_ms": median * 1e3 if median is not None else None}


def summarize_parts(before: str, after: str, client_mean_ttft_ms: float | None) -> dict | None:
    """The parts over a point from the scrapes before and after it; None when the server reports no parts."""
    start, end = histograms(before), histograms(after)
    if not any((TTFT_FAMILY, part) in end for part in TTFT_PARTS):
        return None

    def diffed(family: str, part: str) -> dict:
        return _stats(end.get((family, part), Histogram()).minus(start.get((family, part), Histogram())))

    ttft = {part: diffed(TTFT_FAMILY, part) for part in TTFT_PARTS}
    handoff = {part: diffed(HANDOFF_FAMILY, part) for part in HANDOFF_PARTS}
    proxy_ttft = diffed(PROXY_TTFT_FAMILY, "")
    means = [stats["mean_ms"] for stats in ttft.values()]
    parts_ms = sum(means) if None not in means else None
    handoff_means = [stats["mean_ms"] for stats in handoff.values()]
    return {
        "ttft": ttft, "handoff": handoff, "proxy_ttft": proxy_ttft,
        "split": ttft["queue"]["count"],  # choices whose TTFT was split; proxy_ttft's count has every first token
        "parts_mean_ms": parts_ms,
        "handoff_mean_ms": sum(handoff_means) if None not in handoff_means else None,
        "ratio_to_proxy_ttft": _ratio(parts_ms, proxy_ttft["mean_ms"]),
        "ratio_to_client_ttft": _ratio(parts_ms, client_mean_ttft_ms),
    }


def _ratio(parts_ms: float | None, ttft_ms: float | None) -> float | None:
    return parts_ms / ttft_ms if parts_ms is not None and ttft_ms else None


def parts_table(parts: dict, width: int) -> list[str]:
    """The terminal lines of ``summarize_parts``' result: a row per part, the sums and the ratios."""
    def row(name: str, stats: dict) -> str:
        mean, median = stats["mean_ms"], stats["median_ms"]
        cells = f"{stats['count']:>6}{_ms(mean):>10}{_ms(median):>10}"
        return f"{name:<{width - len(cells)}}{cells}"

    header = f"{'count':>6}{'mean ms':>10}{'p50 ms':>10}"
    lines = [" TTFT in parts (proxy /metrics) ".center(width, "-"), f"{'part':<{width - len(header)}}{header}"]
    lines += [row(part, parts["ttft"][part]) for part in TTFT_PARTS]
    lines.append(row("proxy TTFT", parts["proxy_ttft"]))
    lines.append(f"{'sum of part means / proxy TTFT mean:':<{width - 10}}{_ratio_text(parts['ratio_to_proxy_ttft'])}")
    lines.append(f"{'sum of part means / client TTFT mean:':<{width - 10}}{_ratio_text(parts['ratio_to_client_ttft'])}")
    if any(parts["handoff"][part]["count"] for part in HANDOFF_PARTS):
        lines.append(" then, to the decode worker's first token ".center(width, "-"))
        lines += [row(part, parts["handoff"][part]) for part in HANDOFF_PARTS]
    return lines


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _ratio_text(value: float | None) -> str:
    return f"{'-' if value is None else f'{value:.3f}':>10}"
