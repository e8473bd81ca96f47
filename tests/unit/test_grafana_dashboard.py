"""The shipped Grafana dashboard queries only metrics that Tessera really exports.

Every PromQL expression of ``deploy/grafana/tessera.json`` is reduced to
the metric names it selects; each must resolve to a family of the proxy's
or a worker's real registry (instantiated here), with the suffix its type
allows: ``_total`` for counters, ``_bucket``/``_sum``/``_count`` for
histograms, the bare name for gauges.
"""
import json
import re
from pathlib import Path

import pytest

from common.config.roles import WorkerConfig
from common.runtime.telemetry import WorkerMetrics
from proxy.core.metrics import ProxyMetrics

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "tessera.json"
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "offset", "bool", "and", "or",
            "unless", "inf", "nan"}
SUFFIXES = {"_total": {"counter"}, "_bucket": {"histogram"}, "_sum": {"histogram", "summary"},
            "_count": {"histogram", "summary"}}


def expressions(node) -> list[str]:
    if isinstance(node, dict):
        found = [node["expr"]] if isinstance(node.get("expr"), str) else []
        return found + [e for value in node.values() for e in expressions(value)]
    if isinstance(node, list):
        return [e for item in node for e in expressions(item)]
    return []


def metric_names(expr: str) -> set[str]:
    """Names a PromQL expression selects: not functions, keywords, labels, strings or durations."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)  # string literals
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)  # range selectors ([5m], [$__rate_interval])
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)  # label lists
    text = re.sub(r"\boffset\s+-?\w+", "", text)  # offset durations
    names = set()
    for match in re.finditer(r"(?<![\w.])[a-zA-Z_:][a-zA-Z0-9_:]*", text):  # not the tail of 5m or 1e-9
        name, rest = match.group(), text[match.end():].lstrip()
        if rest.startswith("(") or name in KEYWORDS or text[match.start() - 1:match.start()] == "$":
            continue
        names.add(name)
    return names


def exported_families() -> dict[str, str]:
    """Family name -> type, from the real registries of every role."""
    families = {}
    for registry in (ProxyMetrics().registry, WorkerMetrics(WorkerConfig()).registry):
        for family in registry.collect():
            families[family.name] = family.type
    return families


def resolves(name: str, families: dict[str, str]) -> bool:
    if families.get(name) in ("gauge", "untyped"):
        return True
    return any(name.endswith(suffix) and families.get(name[:-len(suffix)]) in kinds
               for suffix, kinds in SUFFIXES.items())


def test_the_name_extraction_itself():
    expr = ('histogram_quantile(0.99, sum by (le, tenant) '
            '(rate(a_seconds_bucket{job="x",le!="+Inf"}[$__rate_interval])))'
            ' / on (instance) group_left (role) b_info + 1 - scalar(c_total offset 5m) > bool 0')
    assert metric_names(expr) == {"a_seconds_bucket", "b_info", "c_total"}


def test_every_panel_has_a_query():
    dashboard = json.loads(DASHBOARD.read_text())
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert panels
    for panel in panels:
        assert expressions(panel), panel["title"]


def test_every_queried_metric_is_exported():
    families = exported_families()
    exprs = expressions(json.loads(DASHBOARD.read_text()))
    names = {name for expr in exprs for name in metric_names(expr)}
    missing = sorted(n for n in names if not resolves(n, families))
    assert not missing, f"the dashboard queries metrics no registry exports: {missing}"


@pytest.mark.parametrize("name", [
    "tessera_proxy_requests_total", "tessera_proxy_time_to_first_token_seconds_bucket",
    "tessera_proxy_queue_time_seconds_bucket", "tessera_worker_kv_pages_used", "tessera_worker_prefix_cache_hits_total",
    "tessera_worker_kv_transfer_bytes_total", "tessera_worker_kv_transfer_seconds_bucket",
    "tessera_spec_decode_num_accepted_tokens_total", "tessera_spec_decode_num_drafts_total",
    "tessera_proxy_heartbeats_missed_total", "tessera_proxy_malformed_messages_total",
    "tessera_proxy_generation_tokens_total",
])
def test_the_dashboard_covers_the_operations_panels(name):
    exprs = expressions(json.loads(DASHBOARD.read_text()))
    assert any(name in metric_names(expr) for expr in exprs)


def test_wrong_suffixes_do_not_resolve():
    families = exported_families()
    assert not resolves("tessera_proxy_requests", families)  # a counter has no bare series
    assert not resolves("tessera_worker_kv_pages_used_total", families)  # a gauge has no _total
    assert not resolves("tessera_proxy_requests_bucket", families)  # a counter has no buckets
