"""deploy/docker/compose.yaml: valid under the Compose specification, and in step with the rest of deploy/.

No Docker daemon or `docker compose` binary is installable here, so the file is checked against the Compose
specification's own JSON schema (check-jsonschema's vendored copy, pinned with the dev extra), and its
contents against what they name: the image the Dockerfile builds, config files that load as each role's config
with the command's overrides, the ports and addresses those configs use, and Prometheus targets that exist.
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml

from common.config.roles import ProxyConfig, WorkerConfig, load_config, parse_overrides

DOCKER = Path(__file__).resolve().parents[2] / "deploy" / "docker"
COMPOSE = DOCKER / "compose.yaml"
ROLES = ("proxy", "prefill", "decode")


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())  # PyYAML applies the file's merge keys (<<: *tessera)


def role_config(service: dict):
    """The config a service's command loads: its --config file (a mounted path, mapped back) and its --set pairs."""
    command = service["command"]
    mounted = command[command.index("--config") + 1]
    (volume,) = [v for v in service["volumes"] if mounted.startswith(v.split(":")[1] + "/")]
    host, container = volume.split(":")[:2]
    path = (DOCKER / host / Path(mounted).relative_to(container)).resolve()
    overrides = parse_overrides([command[i + 1] for i, arg in enumerate(command) if arg == "--set"])
    if command[0] == "proxy":
        return load_config(ProxyConfig, path, overrides)
    overrides["role"] = command[0]
    return load_config(WorkerConfig, path, overrides)


def check(path: Path) -> subprocess.CompletedProcess:
    checker = Path(sys.executable).with_name("check-jsonschema")
    return subprocess.run([str(checker), "--builtin-schema", "vendor.compose-spec", str(path)],
                          capture_output=True, text=True, timeout=120)


def test_the_file_is_valid_under_the_compose_specification(tmp_path):
    done = check(COMPOSE)
    assert done.returncode == 0, done.stdout + done.stderr
    broken = tmp_path / "compose.yaml"  # the check is not vacuous: a wrong type is refused, named by its path
    broken.write_text(COMPOSE.read_text().replace("stop_grace_period: 45s", "stop_grace_period: [45]"))
    done = check(broken)
    assert done.returncode != 0 and "stop_grace_period" in done.stdout


def test_it_builds_and_names_the_image_the_dockerfile_documents(compose):
    dockerfile = (DOCKER / "Dockerfile.cpu").read_text()
    tag = re.search(r"docker build -f deploy/docker/Dockerfile.cpu -t (\S+) \.", dockerfile).group(1)
    dtype = re.search(r"^ARG MODEL_DTYPES=(\S+)", dockerfile, re.M).group(1)
    for role in ROLES:
        service = compose["services"][role]
        assert service["image"] == tag
        assert (DOCKER / service["build"]["context"] / service["build"]["dockerfile"]).resolve() == \
            DOCKER / "Dockerfile.cpu"
        config = role_config(service)
        assert (config.dtype if role == "proxy" else config.engine.dtype) == dtype  # the model the image prepared


def test_the_roles_load_their_configs_and_reach_each_other(compose):
    services = compose["services"]
    proxy = role_config(services["proxy"])
    assert services["proxy"]["ports"] == [f"127.0.0.1:{proxy.port}:{proxy.port}"]
    worker_port = urlparse(proxy.worker_bind).port
    addresses = {name: s["networks"]["tessera"]["ipv4_address"] for name, s in services.items()
                 if isinstance(s.get("networks"), dict)}
    for role in ("prefill", "decode"):
        config = role_config(services[role])
        assert config.role == role and config.worker_id == f"{role}-0"
        assert config.proxy_address == f"tcp://proxy:{worker_port}"
        assert config.transfer_host == addresses[role]  # its own address on the network
        assert f"127.0.0.1:{config.observability.metrics_port}/healthz" in " ".join(services[role]["healthcheck"]["test"])
        assert int(services[role]["stop_grace_period"].rstrip("s")) > config.drain_timeout_s
    assert f"127.0.0.1:{proxy.port}/healthz" in " ".join(services["proxy"]["healthcheck"]["test"])


def test_prometheus_scrapes_every_role_with_the_repositorys_scrape_config(compose):
    services = compose["services"]
    prometheus = services["prometheus"]
    mounts = dict(v.split(":")[:2] for v in prometheus["volumes"])
    scrape = yaml.safe_load((DOCKER / "../prometheus/prometheus.yml").read_text())
    assert (DOCKER / next(h for h, c in mounts.items() if c.endswith("prometheus.yml"))).resolve() == \
        (DOCKER / "../prometheus/prometheus.yml").resolve()
    targets_dir = DOCKER / next(h for h, c in mounts.items() if c == "/etc/prometheus/targets")
    wanted = {f for job in scrape["scrape_configs"] for sd in job["file_sd_configs"] for f in sd["files"]}
    found = set()
    for name in wanted:  # targets/proxy.json, targets/workers.json
        for group in yaml.safe_load((targets_dir / Path(name).name).read_text()):
            found.update(group["targets"])
    proxy = role_config(services["proxy"])
    expected = {f"proxy:{proxy.port}"} | {f"{role}:{role_config(services[role]).observability.metrics_port}"
                                          for role in ("prefill", "decode")}
    assert found == expected
