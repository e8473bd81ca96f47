"""The metric families docs/observability.md documents, read from its "Metric reference" tables.

Each table row names one or more families (in backquotes), their type and their labels. A counter may be written
with its ``_total`` suffix; the family is the name without it. Where a row lists several families and several
types, a ``_total`` name is a counter and the others take the first type (the row of the disk tier: its gauge of
pages, then its counters).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

REFERENCE = Path(__file__).resolve().parents[1] / "docs" / "observability.md"
TYPES = ("counter", "gauge", "histogram", "summary")
# Labels every scraped series carries, whatever its family: Prometheus's target labels.
TARGET_LABELS = frozenset({"job", "instance"})
# Series names a family of each type is queried by.
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",),
            "summary": ("_sum", "_count", "")}


@dataclass(frozen=True)
class Family:
    name: str
    type: str
    labels: frozenset[str]


def documented_families(text: str | None = None) -> dict[str, Family]:
    text = REFERENCE.read_text() if text is None else text
    section = text.split("## Metric reference", 1)[1].split("\n## ", 1)[0]
    families = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`tessera_"):
            continue
        names = re.findall(r"`([a-z0-9_]+)`", cells[0])
        types = [t.strip() for t in cells[1].split(",")]
        assert all(t in TYPES for t in types), f"docs/observability.md: unknown type in {line!r}"
        labels = frozenset(re.findall(r"`([a-z_]+)`", cells[2]))
        for name in names:
            kind = "counter" if name.endswith("_total") else types[0]
            family = name.removesuffix("_total")
            families[family] = Family(family, kind, labels)
    return families


def family_of(series: str, families: dict[str, Family]) -> Family | None:
    """The documented family a series name belongs to, with the suffix its type allows; None if none."""
    for family in families.values():
        if any(series == family.name + suffix for suffix in SUFFIXES[family.type]):
            return family
    return None
