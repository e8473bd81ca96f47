"""Reading Prometheus' text exposition format (a /metrics scrape) with ``prometheus_client``'s parser.

Tests, benchmarks and the local-cluster launcher read metrics back from
Tessera's and other servers' /metrics; they all go through here.
"""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def _samples(text: str):
    """Every sample of a scrape; a malformed line ends the scrape there (what came before it counts)."""
    try:
        for family in text_string_to_metric_families(text):
            yield from family.samples
    except ValueError:
        return


def label_key(labels: dict[str, str]) -> str:
    """``{a="x",b="y"}`` with the label names sorted; "" for a sample without labels."""
    if not labels:
        return ""
    return "{" + ",".join(f'{name}="{labels[name]}"' for name in sorted(labels)) + "}"


def _lines_of(text: str, name: str) -> str:
    """The sample lines named ``name``, alone: parsed without their family's HELP and TYPE lines, each keeps its own
    name and labels (an untyped family of one name), and the parser reads a few lines instead of the scrape (a
    proxy's scrape has hundreds; a test polling one counter spent 6 ms a scrape parsing the rest)."""
    prefixes = (name + "{", name + " ")
    # "\n" alone ends a line in the format (a label value may hold other line breaks, unescaped)
    return "\n".join(line for line in text.split("\n") if line.lstrip().startswith(prefixes))


def samples(text: str, name: str) -> dict[str, float]:
    """The samples named ``name`` (``x_total`` for a counter's value), keyed by ``label_key``."""
    return {label_key(s.labels): s.value for s in _samples(_lines_of(text, name)) if s.name == name}


def total(text: str, name: str, **labels: str) -> float:
    """The sum of the samples named ``name`` that carry every one of ``labels``."""
    return sum(s.value for s in _samples(_lines_of(text, name))
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def totals(text: str) -> dict[str, float]:
    """Sample name -> its value summed over every label set."""
    out: dict[str, float] = {}
    for s in _samples(text):
        out[s.name] = out.get(s.name, 0.0) + s.value
    return out
