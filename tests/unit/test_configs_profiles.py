"""Every YAML profile under configs/ loads with its role's config class and builds.

The class is chosen by the file name (proxy.yaml is a ProxyConfig, prefill.yaml
and decode.yaml are WorkerConfigs of that role), so a typo in a field name,
a bad value or a worker file whose role disagrees with its name fails here
instead of at a host's start-up.
"""
from pathlib import Path

import pytest

from common.config.base import ConfigError
from common.config.roles import ProxyConfig, WorkerConfig, load_config, parse_overrides

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
CLASSES = {"proxy": ProxyConfig, "prefill": WorkerConfig, "decode": WorkerConfig, "both": WorkerConfig}
PROFILES = sorted(CONFIGS.rglob("*.yaml"))


def test_every_profile_has_the_three_roles():
    profiles = {path.parent.name for path in PROFILES}
    assert {"local", "single-node", "multi-node"} <= profiles
    for profile in ("single-node", "multi-node"):
        assert {p.name for p in (CONFIGS / profile).glob("*.yaml")} >= {"proxy.yaml", "prefill.yaml", "decode.yaml"}


@pytest.mark.parametrize("path", PROFILES, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_profile_builds_with_its_role_class(path):
    assert path.stem in CLASSES, f"{path}: no config class for {path.stem!r}; known: {sorted(CLASSES)}"
    cls = CLASSES[path.stem]
    config = load_config(cls, path)
    assert isinstance(config, cls)
    if cls is WorkerConfig:
        assert config.role == path.stem, f"{path} says role {config.role!r}"
        assert config.engine.model
    text = path.read_text()
    assert text.startswith("#"), f"{path} must open with a comment: what profile, what to edit"


@pytest.mark.parametrize("profile", ["single-node", "multi-node"])
def test_overrides_reach_nested_fields_of_a_profile(profile):
    worker = load_config(WorkerConfig, CONFIGS / profile / "decode.yaml", parse_overrides([
        "worker_id=decode-7", "proxy_address=tcp://10.77.0.10:5555", "engine.dtype=float32",
        "engine.num_threads=1",
    ]))
    assert (worker.worker_id, worker.proxy_address) == ("decode-7", "tcp://10.77.0.10:5555")
    assert (worker.engine.dtype, worker.engine.num_threads) == ("float32", 1)
    proxy = load_config(ProxyConfig, CONFIGS / profile / "proxy.yaml", parse_overrides(["heartbeat_timeout_s=2"]))
    assert proxy.heartbeat_timeout_s == 2


def test_a_bad_override_of_a_profile_names_the_field():
    with pytest.raises(ConfigError, match="'dtyp'"):
        load_config(WorkerConfig, CONFIGS / "multi-node" / "prefill.yaml", parse_overrides(["engine.dtyp=float32"]))
    with pytest.raises(ConfigError, match="'engine.dtype'"):
        load_config(WorkerConfig, CONFIGS / "multi-node" / "prefill.yaml", parse_overrides(["engine.dtype=int3"]))


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_the_multi_node_workers_serve_metrics_and_health_for_their_host(role):
    worker = load_config(WorkerConfig, CONFIGS / "multi-node" / f"{role}.yaml")
    assert (worker.observability.metrics_host, worker.observability.metrics_port) == ("0.0.0.0", 9100)
