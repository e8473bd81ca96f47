"""The shipped Grafana dashboard queries only metrics that Tessera really exports, by labels they carry.

Every PromQL expression of ``deploy/grafana/tessera.json`` is reduced to
the metric names it selects; each must resolve to a family of the proxy's
or a worker's real registry (instantiated here), with the suffix its type
allows: ``_total`` for counters, ``_bucket``/``_sum``/``_count`` for
histograms, the bare name for gauges; and to a family docs/observability.md
documents. Every label an expression names, in a selector or in a
``by``/``on``/``group_left`` list, must be one its families carry (as
documented, which must be what the code registers) or a target label. The
template variables model, role and worker exist, read labels that exist,
and are used.
"""
import json
import re
from pathlib import Path

import pytest

from common.config.roles import WorkerConfig
from common.runtime.telemetry import WorkerMetrics
from proxy.core.metrics import ProxyMetrics
from tests.metric_reference import TARGET_LABELS, documented_families, family_of

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "tessera.json"
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "offset", "bool", "and", "or",
            "unless", "inf", "nan"}
SUFFIXES = {"_total": {"counter"}, "_bucket": {"histogram"}, "_sum": {"histogram", "summary"},
            "_count": {"histogram", "summary"}}
VARIABLES = ("model", "role", "worker")
GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
SELECTOR = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*\{([^}]*)\}")
MATCHER = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')


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


def exported_labels() -> dict[str, frozenset[str]]:
    """Family name -> its label names, as the registries' collectors declare them (prometheus_client keeps them
    in ``_labelnames``, on a metric or on the families a custom collector yields)."""
    labels = {}
    for registry in (ProxyMetrics().registry, WorkerMetrics(WorkerConfig()).registry):
        for collector in list(registry._collector_to_names):
            if hasattr(collector, "_labelnames") and hasattr(collector, "_name"):
                labels[collector._name] = frozenset(collector._labelnames)
            else:
                labels.update((f.name, frozenset(getattr(f, "_labelnames", ()))) for f in collector.collect())
    return labels


def selectors(expr: str) -> list[tuple[str, list[tuple[str, str, str]]]]:
    """Each metric a selector with matchers names, and its matchers: (label, operator, value)."""
    return [(name, MATCHER.findall(body)) for name, body in SELECTOR.findall(expr)]


def grouping_labels(expr: str) -> set[str]:
    return {label.strip() for group in GROUPING.findall(expr) for label in group.split(",") if label.strip()}


def label_values_query(variable: dict) -> tuple[str, str]:
    """A variable's ``label_values(SELECTOR, LABEL)``: the selector and the label."""
    query = variable["query"] if isinstance(variable["query"], str) else variable["query"]["query"]
    selector, label = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", query).groups()
    return selector, label


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


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
    # per-tenant latency and service
    "tessera_proxy_tenant_time_to_first_token_seconds_bucket",
    "tessera_proxy_tenant_time_per_output_token_seconds_bucket",
    "tessera_proxy_tenant_service_total",
    # migrations and resumed streams
    "tessera_proxy_migrations_total", "tessera_proxy_migration_phase_seconds_bucket",
    "tessera_proxy_resumed_streams_total",
    # the adaptive controller's decisions
    "tessera_tac_decisions_total", "tessera_tac_knob", "tessera_tac_routing_weight",
    # the prefill/decode split
    "tessera_proxy_worker_requests_total", "tessera_worker_info",
])
def test_the_dashboard_covers_the_operations_panels(name):
    exprs = expressions(json.loads(DASHBOARD.read_text()))
    assert any(name in metric_names(expr) for expr in exprs)


def test_wrong_suffixes_do_not_resolve():
    families = exported_families()
    assert not resolves("tessera_proxy_requests", families)  # a counter has no bare series
    assert not resolves("tessera_worker_kv_pages_used_total", families)  # a gauge has no _total
    assert not resolves("tessera_proxy_requests_bucket", families)  # a counter has no buckets


def test_the_label_extraction_itself():
    expr = ('sum by (role, worker_id) (a_total{x="1", y=~"$v"} * on (instance) group_left (role) '
            'b_info{role=~"$role"}) / c{z!="q\\"r"}')
    assert selectors(expr) == [("a_total", [("x", "=", "1"), ("y", "=~", "$v")]),
                               ("b_info", [("role", "=~", "$role")]), ("c", [("z", "!=", 'q\\"r')])]
    assert grouping_labels(expr) == {"role", "worker_id", "instance"}


def test_every_queried_metric_is_a_documented_family_whose_labels_the_code_declares():
    documented, declared = documented_families(), exported_labels()
    for expr in expressions(dashboard()):
        for name in metric_names(expr):
            family = family_of(name, documented)
            assert family, f"{name} is no family docs/observability.md documents"
            assert family.labels == declared[family.name], f"{family.name}: docs/observability.md's labels are wrong"


def test_every_label_a_query_names_is_one_its_families_carry():
    documented = documented_families()
    for expr in expressions(dashboard()):
        families = {name: family_of(name, documented) for name in metric_names(expr)}
        carried = TARGET_LABELS.union(*(f.labels for f in families.values()))
        if any(name.endswith("_bucket") for name in families):
            carried |= {"le"}
        for name, matchers in selectors(expr):
            own = families[name].labels | TARGET_LABELS
            unknown = {label for label, _, _ in matchers} - own
            assert not unknown, f"{name} has no label {sorted(unknown)}: {expr}"
        unknown = grouping_labels(expr) - carried
        assert not unknown, f"no family of the expression carries {sorted(unknown)}: {expr}"


def test_the_variables_model_role_and_worker_exist_and_read_labels_that_exist():
    documented = documented_families()
    variables = {v["name"]: v for v in dashboard()["templating"]["list"]}
    for name in VARIABLES:
        variable = variables[name]
        assert variable["type"] == "query" and variable["datasource"]["uid"] == "${datasource}", name
        assert variable["multi"] and variable["includeAll"], f"{name}: several values, or all"
        selector, label = label_values_query(variable)
        family = documented[metric_names(selector).pop()]
        assert label in family.labels, f"{name}: {family.name} has no label {label}"
        assert {m[0] for _, matchers in selectors(selector) for m in matchers} <= family.labels, name
    worker_selector, _ = label_values_query(variables["worker"])
    assert "$role" in worker_selector and "$model" in worker_selector, "the workers offered follow role and model"


@pytest.mark.parametrize("name", VARIABLES)
def test_each_variable_filters_panels_with_a_regex_matcher(name):
    """A multi-value or All variable expands to a regex (a|b): only =~ matches it."""
    uses = [(label, operator) for expr in expressions(dashboard()) for _, matchers in selectors(expr)
            for label, operator, value in matchers if re.search(rf"\$\{{?{name}\b", value)]
    assert uses, f"no panel uses ${name}"
    assert all(operator == "=~" for _, operator in uses), uses
