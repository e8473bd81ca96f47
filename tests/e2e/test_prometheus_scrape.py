"""A real Prometheus scrapes a real local cluster with the shipped config.

The shipped ``deploy/prometheus/prometheus.yml`` is copied with only its
scrape interval shortened; the targets go into its file_sd files. After one
completion through the proxy, Prometheus's query API must return the
proxy's request counter and the workers' request counters, which proves
every role's endpoint is scrapeable by the config operators will use. The
same Prometheus then evaluates every query of the shipped Grafana dashboard, once it holds the workers' rates.
Skipped only when the ``prometheus`` binary is absent (.ci/run installs it).
"""
import json
import shutil
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from common.cli.local_cluster import LocalCluster, free_port, post_json
from tests.conditions import settle

STARTUP_S = 60.0  # bounds the wait for Prometheus to listen and load its rules (a second alone; more on loaded cores)

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
SHIPPED = DEPLOY / "prometheus"
PROMETHEUS = shutil.which("prometheus")
QUERY_TIMEOUT_S = 60
pytestmark = pytest.mark.skipif(PROMETHEUS is None, reason="the prometheus binary is not installed "
                                "(Debian package 'prometheus'; .ci/run installs it)")


@pytest.fixture(scope="module")
def cluster(tiny_chat_model_dir, tmp_path_factory):
    c = LocalCluster.for_tests(tiny_chat_model_dir, tmp_path_factory.mktemp("prom-cluster-logs"), transfer_backend="zmq").start()
    yield c
    codes = c.stop()
    assert all(code == 0 for code in codes.values()), codes


@pytest.fixture(scope="module")
def prometheus(cluster, tmp_path_factory):
    home = tmp_path_factory.mktemp("prometheus")
    config = yaml.safe_load((SHIPPED / "prometheus.yml").read_text())
    config["global"]["scrape_interval"] = "1s"
    config["global"]["scrape_timeout"] = "1s"
    (home / "prometheus.yml").write_text(yaml.safe_dump(config))
    shutil.copy(SHIPPED / "alerts.yml", home / "alerts.yml")
    (home / "targets").mkdir()
    (home / "targets" / "proxy.json").write_text(json.dumps([{"targets": [f"127.0.0.1:{cluster.port}"]}]))
    workers = [f"127.0.0.1:{port}" for port in cluster.metrics_ports.values()]
    (home / "targets" / "workers.json").write_text(json.dumps([{"targets": workers}]))
    port = free_port()
    log = open(home / "prometheus.log", "w")
    proc = subprocess.Popen([PROMETHEUS, f"--config.file={home / 'prometheus.yml'}",
                             f"--storage.tsdb.path={home / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    settle(lambda: _ready(base), bool, STARTUP_S, f"Prometheus answers /-/ready (log: {home / 'prometheus.log'})")
    yield base
    proc.terminate()
    proc.wait(timeout=30)


def _ready(base: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base}/-/ready", timeout=5) as resp:
            return resp.status == 200
    except OSError:  # not listening yet, or still loading its rules (503)
        return False


def query(base: str, expr: str) -> list[dict]:
    url = f"{base}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            body = json.loads(resp.read())
    except urllib.error.HTTPError as error:  # 400: a syntax error; 422: the query failed on the data it read
        raise AssertionError(f"Prometheus answered {error.code} to {expr!r}: {error.read().decode()}") from None
    assert body["status"] == "success", body
    return body["data"]["result"]


def wait_for(base: str, expr: str, minimum: float) -> list[dict]:
    """Until Prometheus answers ``expr`` with samples adding up to ``minimum`` (its next scrapes): the answer."""
    def answer() -> list[dict]:
        try:
            return query(base, expr)
        except OSError:  # Prometheus still starting
            return []
    return settle(answer, lambda result: bool(result) and sum(float(r["value"][1]) for r in result) >= minimum,
                  QUERY_TIMEOUT_S, f"{expr} reaches {minimum} in Prometheus (scrape_interval)")


def test_workers_serve_health_and_readiness(cluster):
    for name in cluster.metrics_ports:
        assert cluster.get("/healthz", cluster.worker_url(name))[0] == 200
        status, body = cluster.get("/readyz", cluster.worker_url(name))
        assert (status, json.loads(body)["status"]) == (200, "ready")


def test_prometheus_scrapes_every_role(cluster, prometheus):
    base = prometheus
    body = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Say hi"}],
            "max_tokens": 4, "temperature": 0.0}
    status, answer = post_json(cluster.url + "/v1/chat/completions", body)
    assert status == 200, answer

    proxy = wait_for(base, 'sum(tessera_proxy_requests_total{job="tessera-proxy",status="200"})', 1)
    assert float(proxy[0]["value"][1]) == 1.0
    by_tenant = wait_for(base, 'tessera_proxy_tenant_requests_total{status="ok"}', 1)
    assert by_tenant[0]["metric"]["tenant"] == "default"
    stages = wait_for(base, 'sum by (stage) (tessera_worker_requests_total{status="completed"})', 2)
    assert {r["metric"]["stage"]: float(r["value"][1]) for r in stages} == {"prefill": 1.0, "decode": 1.0}
    up = query(base, "up")
    assert len(up) == 1 + len(cluster.metrics_ports), up
    assert all(r["value"][1] == "1" for r in up), up
    assert {r["metric"]["job"] for r in up} == {"tessera-proxy", "tessera-workers"}


def test_every_dashboard_query_is_valid_promql(prometheus):
    dashboard = json.loads((DEPLOY / "grafana" / "tessera.json").read_text())
    # Until each worker's counters have two scrapes joined to its identity: a rate over series that do not exist yet
    # answers empty, and a join that cannot work (labels the "one" side lacks) fails only on data.
    wait_for(prometheus, "count(rate(tessera_worker_requests_total[1m]) * on (instance) group_left "
                         "tessera_worker_info)", 1)
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert exprs
    # The template variables as Grafana expands All for the =~ matchers that take them: a regex.
    values = {"$__rate_interval": "1m"}
    values.update((f"${v['name']}", ".*") for v in dashboard["templating"]["list"] if v["type"] == "query")
    for expr in exprs:
        for variable, value in values.items():
            expr = expr.replace(variable, value)
        query(prometheus, expr)  # raises on a syntax error (HTTP 400)


def test_prometheus_loads_the_shipped_alert_rules_and_a_healthy_cluster_fires_none(cluster, prometheus):
    with urllib.request.urlopen(f"{prometheus}/api/v1/rules?type=alert", timeout=5) as resp:
        groups = json.load(resp)["data"]["groups"]
    assert {g["name"] for g in groups} == {"tessera-availability", "tessera-latency-slo", "tessera-capacity",
                                           "tessera-faults"}
    rules = [r for g in groups for r in g["rules"]]
    assert len(rules) == 10 and all(r["health"] != "err" for r in rules), rules
    assert not [r["name"] for r in rules if r["state"] == "firing"]
