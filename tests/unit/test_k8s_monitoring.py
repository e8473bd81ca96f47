"""The optional monitoring components scrape what Tessera exports and scale its pools on metrics that exist.

components/service-monitor: the Prometheus Operator's ServiceMonitor is a custom resource, which kubernetes-validate
has no schema for, so its shape is checked here: the fields used are ones the CRD defines, each selector matches
Services of the layout by their labels, each endpoint's port is a port of those Services, every Tessera pod's
metrics endpoint (its prometheus.io annotations) is scraped exactly once, and the job labels are the ones the alert
rules select on.

components/autoscaling: each HorizontalPodAutoscaler scales a worker Deployment that exists and leaves it no
replicas field to fight over; each metric it reads is a gauge family that docs/observability.md documents and the
registries export, of the pods it scales (Pods) or of the proxy (External); and the Prometheus adapter's rules
(prometheus-adapter-values.yaml) serve each one under that name, from that family's series.
"""
from __future__ import annotations

import re

import pytest
import yaml

from common.config.roles import WorkerConfig
from common.runtime.telemetry import WorkerMetrics
from proxy.core.metrics import ProxyMetrics
from tests.k8s_layouts import (K8S, LAYOUT_IDS, LAYOUTS, WORKER_ROLES, component, container, one, pod_labels, port,
                               render, selects, tessera_workloads)
from tests.metric_reference import documented_families

MONITORED = [(layout, name) for layout, name in zip(LAYOUTS, LAYOUT_IDS) if "service-monitor" in layout[1]]
AUTOSCALED = [(layout, name) for layout, name in zip(LAYOUTS, LAYOUT_IDS) if "autoscaling" in layout[1]]
ADAPTER_VALUES = K8S / "components" / "autoscaling" / "prometheus-adapter-values.yaml"
PROMETHEUS = K8S.parent / "prometheus"
# The fields of monitoring.coreos.com/v1 ServiceMonitor these manifests may use (the CRD defines many more).
SERVICE_MONITOR_SPEC = {"selector", "namespaceSelector", "endpoints", "jobLabel", "targetLabels", "podTargetLabels"}
ENDPOINT_FIELDS = {"port", "path", "scheme", "interval", "scrapeTimeout", "relabelings", "metricRelabelings",
                   "honorLabels", "tlsConfig"}
RELABEL_FIELDS = {"sourceLabels", "separator", "targetLabel", "regex", "replacement", "action", "modulus"}


@pytest.fixture(scope="module", params=[layout for layout, _ in MONITORED], ids=[name for _, name in MONITORED])
def monitored(request) -> list[dict]:
    return render(*request.param)


@pytest.fixture(scope="module", params=[layout for layout, _ in AUTOSCALED], ids=[name for _, name in AUTOSCALED])
def autoscaled(request) -> list[dict]:
    return render(*request.param)


def _service_monitors(objects: list[dict]) -> list[dict]:
    monitors = [o for o in objects if o["kind"] == "ServiceMonitor"]
    assert monitors
    return monitors


def _scraped_services(monitor: dict, objects: list[dict]) -> list[dict]:
    """The Services a ServiceMonitor selects: by their own labels, in its namespace unless it names others."""
    namespaces = monitor["spec"].get("namespaceSelector", {}).get("matchNames", [monitor["metadata"]["namespace"]])
    return [o for o in objects if o["kind"] == "Service" and o["metadata"]["namespace"] in namespaces
            and selects(monitor["spec"]["selector"], o["metadata"].get("labels", {}))]


def test_service_monitors_have_the_crd_shape(monitored):
    for monitor in _service_monitors(monitored):
        name = monitor["metadata"]["name"]
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1", name
        assert set(monitor) == {"apiVersion", "kind", "metadata", "spec"}, name
        assert set(monitor["spec"]) <= SERVICE_MONITOR_SPEC and monitor["spec"]["endpoints"], name
        assert set(monitor["spec"]["selector"]) <= {"matchLabels", "matchExpressions"}, name
        for endpoint in monitor["spec"]["endpoints"]:
            assert set(endpoint) <= ENDPOINT_FIELDS and isinstance(endpoint["port"], str), name
            assert endpoint.get("path", "/metrics").startswith("/"), name
            assert re.fullmatch(r"\d+(ms|s|m|h)", endpoint.get("interval", "30s")), name
            for relabeling in endpoint.get("relabelings", []):
                assert set(relabeling) <= RELABEL_FIELDS, name


def test_service_monitors_select_services_whose_ports_they_name(monitored):
    for monitor in _service_monitors(monitored):
        services = _scraped_services(monitor, monitored)
        assert services, f"ServiceMonitor {monitor['metadata']['name']} selects no Service"
        named = {p.get("name") for service in services for p in service["spec"]["ports"]}
        for endpoint in monitor["spec"]["endpoints"]:
            assert endpoint["port"] in named, f"{monitor['metadata']['name']}: no selected Service has that port"


def _targets(objects: list[dict]) -> list[tuple[str, str, str, int, str]]:
    """(ServiceMonitor, job, workload, container port, path) for every pod endpoint the monitors scrape."""
    targets = []
    for monitor in _service_monitors(objects):
        for endpoint in monitor["spec"]["endpoints"]:
            jobs = [r["replacement"] for r in endpoint.get("relabelings", []) if r.get("targetLabel") == "job"]
            for service in _scraped_services(monitor, objects):
                job = jobs[-1] if jobs else service["metadata"]["name"]  # the operator's default job: the Service
                for service_port in (p for p in service["spec"]["ports"] if p.get("name") == endpoint["port"]):
                    for workload_ in (w for w in tessera_workloads(objects)
                                      if selects(service["spec"]["selector"], pod_labels(w))):
                        number = port(container(workload_), service_port["targetPort"])
                        targets.append((monitor["metadata"]["name"], job, workload_["metadata"]["name"], number,
                                        endpoint.get("path", "/metrics")))
    return targets


def test_every_tessera_pod_is_scraped_once_where_it_serves_metrics(monitored):
    targets = _targets(monitored)
    for workload_ in tessera_workloads(monitored):
        annotations = workload_["spec"]["template"]["metadata"]["annotations"]
        wanted = (int(annotations["prometheus.io/port"]), annotations["prometheus.io/path"])
        scraped = [t for t in targets if t[2] == workload_["metadata"]["name"]]
        assert [(number, path) for *_, number, path in scraped] == [wanted], workload_["metadata"]["name"]


def test_the_jobs_are_those_the_alert_rules_select(monitored):
    rules = yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())
    alerts = {r["alert"]: r["expr"] for group in rules["groups"] for r in group["rules"] if "alert" in r}
    down_job = {role: re.search(r'up\{job="([^"]+)"\}', alerts[alert]).group(1)
                for role, alert in (("proxy", "TesseraProxyDown"), ("worker", "TesseraWorkerDown"))}
    scrape_jobs = {j["job_name"] for j in yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())["scrape_configs"]}
    workloads_by_name = {w["metadata"]["name"]: w for w in tessera_workloads(monitored)}
    for _, job, workload_name, _, _ in _targets(monitored):
        role = "proxy" if component(workloads_by_name[workload_name]) == "proxy" else "worker"
        assert job == down_job[role] and job in scrape_jobs, f"{workload_name} scraped as job {job!r}"


def _exported() -> dict[str, str]:
    """Family name -> the role whose registry exports it."""
    exported = {family.name: "proxy" for family in ProxyMetrics().registry.collect()}
    exported.update({family.name: "worker" for family in WorkerMetrics(WorkerConfig()).registry.collect()})
    return exported


def _adapter_rules() -> dict[str, dict[str, str]]:
    """API (custom, external) -> the name each rule serves -> the metric its seriesQuery reads."""
    rules = yaml.safe_load(ADAPTER_VALUES.read_text())["rules"]
    served = {}
    for api in ("custom", "external"):
        served[api] = {}
        for rule in rules.get(api, []):
            series = re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", rule["seriesQuery"].strip("'")).group()
            overrides = rule["resources"]["overrides"]
            assert overrides["namespace"] == {"resource": "namespace"}, rule
            if api == "custom":
                assert overrides["pod"] == {"resource": "pod"}, "a Pods metric is each pod's series"
            served[api][rule["name"]["as"]] = series
    return served


def test_autoscalers_scale_worker_deployments_the_hpa_alone_sizes(autoscaled):
    hpas = [o for o in autoscaled if o["kind"] == "HorizontalPodAutoscaler"]
    scaled = set()
    for hpa in hpas:
        ref = hpa["spec"]["scaleTargetRef"]
        assert (ref["apiVersion"], ref["kind"]) == ("apps/v1", "Deployment")
        deployment = one(autoscaled, "Deployment", ref["name"])
        assert component(deployment) in WORKER_ROLES, f"{ref['name']} is not a worker pool"
        assert "replicas" not in deployment["spec"], f"{ref['name']}: apply would reset what the HPA set"
        assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
        assert hpa["metadata"]["namespace"] == deployment["metadata"]["namespace"]
        scaled.add(component(deployment))
    assert scaled == set(WORKER_ROLES), "each pool scales on its own signals"


def test_autoscalers_read_documented_exported_gauges_the_adapter_serves(autoscaled):
    documented, exported, served = documented_families(), _exported(), _adapter_rules()
    for hpa in (o for o in autoscaled if o["kind"] == "HorizontalPodAutoscaler"):
        for metric in hpa["spec"]["metrics"]:
            kind = metric["type"]
            name = metric[kind.lower()]["metric"]["name"]
            assert name in documented, f"{name} is not in docs/observability.md"
            # An HPA compares a value: a gauge; a counter would need a rate the adapter does not take.
            assert documented[name].type == "gauge", f"{name} is a {documented[name].type}"
            assert metric[kind.lower()]["target"]["type"] == "AverageValue"
            if kind == "Pods":
                assert exported.get(name) == "worker", f"{name}: the pods it scales must export it"
                assert served["custom"].get(name) == name, f"no adapter rule serves {name} per pod"
            else:
                assert kind == "External" and exported.get(name) == "proxy", f"{name}: the proxy's series"
                assert served["external"].get(name) == name, f"no adapter rule serves {name} as external"
