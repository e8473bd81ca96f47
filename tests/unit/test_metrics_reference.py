"""Every metric family the proxy and the workers export is in docs/observability.md's reference."""
from __future__ import annotations

import re
from pathlib import Path

from common.config.roles import ProxyConfig, WorkerConfig
from common.runtime.telemetry import WorkerMetrics
from proxy.cluster.cluster import Cluster
from proxy.core.metrics import ProxyMetrics
from proxy.core.routing import PrefixAwareRouting

REFERENCE = Path(__file__).parents[2] / "docs" / "observability.md"
SUFFIXES = ("", "_total", "_seconds", "_bucket", "_sum", "_count")


def exported_families() -> set[str]:
    """The families on the proxy's /metrics (with the cluster's scrape-time collectors) and on a worker's."""
    proxy = ProxyMetrics()
    Cluster(ProxyConfig(), PrefixAwareRouting(0, 600), proxy)
    worker = WorkerMetrics(WorkerConfig(role="decode", worker_id="d0"))
    return {family.name for registry in (proxy.registry, worker.registry) for family in registry.collect()
            if family.name.startswith("tessera_")}


def test_every_exported_family_is_documented():
    documented = set(re.findall(r"tessera_[a-z0-9_]+", REFERENCE.read_text()))
    families = exported_families()
    assert len(families) > 50, "the registries came back nearly empty: the test no longer sees what is exported"
    missing = sorted(name for name in families if not any(name + suffix in documented for suffix in SUFFIXES))
    assert not missing, f"exported but not in docs/observability.md's metric reference: {missing}"
