"""The Kubernetes manifests render, pass the API schemas, and agree with the code they deploy.

Every layout of tests/k8s_layouts.py (each overlay under deploy/k8s/overlays, and the components of
deploy/k8s/components on the profiles they are written for) is rendered, and every object is validated offline in
strict mode (unknown fields are errors) with kubernetes-validate against the oldest and newest Kubernetes releases
the manifests support; the Prometheus Operator's objects, whose schemas it lacks, are checked by hand in
test_k8s_monitoring.py. The rest are the checks a schema cannot make: the role configs in the ConfigMap load with
the real config classes after the pod's own ``--set`` overrides; the addresses the workers dial reach every proxy
before it is ready; several proxies share one Redis that exists; probes, Services and budgets point at ports and
pods that exist; grace periods cover the drain; every pod runs locked down; the GPU profile asks for GPUs and runs
the engine on them; the model the configs name is in the image or on a mounted volume.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from common.config.roles import ProxyConfig
from common.runtime.proxy_links import proxy_addresses
from common.storage.model_store import EMBEDDED_MODEL, EMBEDDED_NAMES
from tests.k8s_layouts import (K8S, LAYOUT_IDS, LAYOUTS, POD_FIELDS, WORKER_ROLES, component, container, load_role,
                               one, pod_labels, port, render, selects, tessera_workloads, workloads)

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate (dev extra) is missing")

# Oldest and newest Kubernetes releases the manifests are written for.
K8S_VERSIONS = ("1.31.0", "1.37.0")
# What every layout holds, and what an overlay or a component adds to it.
BASE_KINDS = {"ConfigMap", "Deployment", "Namespace", "NetworkPolicy", "PodDisruptionBudget", "Service",
              "ServiceAccount"}
ADDED_KINDS = {"several-proxies": {"StatefulSet"}, "model-volume": {"PersistentVolumeClaim"},
               "service-monitor": {"ServiceMonitor"}, "autoscaling": {"HorizontalPodAutoscaler"}}
# Custom resources: kubernetes-validate has no schema for them.
CRD_GROUPS = ("monitoring.coreos.com/",)
# After the drain: a worker's goodbye (the I/O thread's join in common/runtime/worker_runtime.py), then
# the process exit of either role (up to 10 s measured on the 2-core development machine).
WORKER_GOODBYE_S = 5
PROCESS_EXIT_S = 10


@pytest.fixture(scope="module", params=LAYOUTS, ids=LAYOUT_IDS)
def rendered(request) -> tuple[tuple[str, tuple[str, ...]], list[dict]]:
    overlay, components = request.param
    return request.param, render(overlay, components)


def _proxies(objects: list[dict]) -> list[dict]:
    return [w for w in tessera_workloads(objects) if component(w) == "proxy"]


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_object_passes_the_strict_schema(rendered, version):
    (overlay, components), objects = rendered
    expected = BASE_KINDS.union(*(ADDED_KINDS.get(name, set()) for name in (overlay, *components)))
    assert {o["kind"] for o in objects} == expected
    for obj in objects:
        if not obj["apiVersion"].startswith(CRD_GROUPS):
            kubernetes_validate.validate(obj, version, strict=True)


def test_role_configs_load_with_the_pods_overrides(rendered, tmp_path):
    _, objects = rendered
    (proxy_workload,) = _proxies(objects)
    proxy = load_role(objects, proxy_workload, tmp_path)
    assert proxy.port == port(container(proxy_workload), "http")
    for role in WORKER_ROLES:
        deployment = one(objects, "Deployment", f"tessera-{role}")
        worker = load_role(objects, deployment, tmp_path)
        assert worker.role == role
        assert worker.worker_id == POD_FIELDS["metadata.name"], "worker_id must be the pod's name"
        assert worker.transfer_host == POD_FIELDS["status.podIP"], "KV pulls go pod to pod: the pod's IP"
        metrics = (worker.observability.metrics_host, worker.observability.metrics_port)
        assert metrics == ("0.0.0.0", port(container(deployment), "metrics"))
        # An empty model_name announces the registered name: the embedded model's for its aliases, else the
        # model directory's.
        embedded = worker.engine.model in EMBEDDED_NAMES
        announced = worker.model_name or (EMBEDDED_MODEL if embedded else Path(worker.engine.model).name)
        assert announced == proxy.served_model_name
        assert worker.engine.model == proxy.model, "the proxy's tokenizer must be the workers' model"
        assert worker.engine.dtype == proxy.dtype or not embedded, "the embedded model is prepared per dtype"


def test_workers_dial_every_proxy_at_an_address_that_reaches_it_before_it_is_ready(rendered, tmp_path):
    """A proxy's /readyz waits for workers to register: an address only ready pods answer on would deadlock. A
    proxy no worker dials would never be ready."""
    _, objects = rendered
    (proxy,) = _proxies(objects)
    bind_port = int(load_role(objects, proxy, tmp_path).worker_bind.rsplit(":", 1)[1])
    name = proxy["metadata"]["name"]
    # A StatefulSet's pods are NAME-0, NAME-1...; a Deployment's one pod stands for itself here.
    expected = {f"{name}-{i}" for i in range(proxy["spec"]["replicas"])} if proxy["kind"] == "StatefulSet" else {name}
    for role in WORKER_ROLES:
        worker = load_role(objects, one(objects, "Deployment", f"tessera-{role}"), tmp_path)
        reached = set()
        for address in proxy_addresses(worker.proxy_address):
            host, service_port = re.fullmatch(r"tcp://([a-z0-9.-]+):(\d+)", address).groups()
            *pod, service_name = host.split(".")
            service = one(objects, "Service", service_name)
            assert service["spec"].get("publishNotReadyAddresses") is True, f"{service_name} hides unready proxies"
            assert selects(service["spec"]["selector"], pod_labels(proxy)), f"{service_name} misses the proxy"
            if pod:  # tessera-proxy-N.<headless Service>: one pod of a StatefulSet
                assert service["spec"].get("clusterIP") == "None" and proxy["spec"]["serviceName"] == service_name
                reached.update(pod)
            else:  # a Service in front of the one proxy pod
                assert proxy["kind"] == "Deployment" and proxy["spec"]["replicas"] == 1
                reached.add(name)
            (entry,) = [p for p in service["spec"]["ports"] if p["port"] == int(service_port)]
            assert port(container(proxy), entry["targetPort"]) == bind_port
        assert reached == expected, f"{role} workers register with {sorted(reached)}, not with every proxy"


def test_several_proxies_share_state_through_the_redis_service_that_exists(rendered, tmp_path):
    _, objects = rendered
    for proxy_workload in _proxies(objects):
        proxy = load_role(objects, proxy_workload, tmp_path)
        replicas = proxy_workload["spec"]["replicas"]
        if replicas == 1:
            assert not proxy.shared_state.redis_url, "one proxy has nothing to share"
            continue
        # Without a Redis each proxy would keep its own tenant counters and admit to every decode slot.
        match = re.fullmatch(r"redis://([a-z0-9-]+):(\d+)/\d+", proxy.shared_state.redis_url)
        assert match, f"shared_state.redis_url = {proxy.shared_state.redis_url!r}"
        service = one(objects, "Service", match.group(1))
        (redis,) = [w for w in workloads(objects) if selects(service["spec"]["selector"], pod_labels(w))]
        (entry,) = [p for p in service["spec"]["ports"] if p["port"] == int(match.group(2))]
        port(container(redis), entry["targetPort"])
        assert container(redis)["command"][0] == "redis-server"
        # Before its first sync a proxy admits to its share of the decode slots: together at most all of them.
        assert proxy.shared_state.decode_slot_share * replicas <= 1


def test_services_and_budgets_select_pods_and_ports_that_exist(rendered):
    _, objects = rendered
    for workload_ in workloads(objects):
        assert selects(workload_["spec"]["selector"], pod_labels(workload_))
    for obj in objects:
        if obj["kind"] not in ("Service", "PodDisruptionBudget"):
            continue
        targets = [w for w in workloads(objects) if selects(obj["spec"]["selector"], pod_labels(w))]
        assert len(targets) == 1, f"{obj['kind']} {obj['metadata']['name']} selects {len(targets)} workloads"
        for service_port in obj["spec"].get("ports", []):
            port(container(targets[0]), service_port["targetPort"])


def test_every_pod_is_locked_down(rendered):
    _, objects = rendered
    for workload_ in workloads(objects):
        pod, container_ = workload_["spec"]["template"]["spec"], container(workload_)
        name = workload_["metadata"]["name"]
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] > 0, name
        assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault", name
        assert pod["automountServiceAccountToken"] is False and pod["enableServiceLinks"] is False, name
        locked = container_["securityContext"]
        assert locked["readOnlyRootFilesystem"] is True and locked["allowPrivilegeEscalation"] is False, name
        assert locked["capabilities"]["drop"] == ["ALL"], name
        assert not any("hostPath" in volume for volume in pod["volumes"]), f"{name}: the namespace is restricted"
        assert re.fullmatch(r"[\w./-]+:\d[\w.-]*", container_["image"]), f"{name}: pin a version tag"
        requests, limits = container_["resources"]["requests"], container_["resources"]["limits"]
        assert limits["memory"] == requests["memory"], name
        assert container_["readinessProbe"] and container_["livenessProbe"], name


def test_tessera_pods_are_probed_and_given_time_to_drain(rendered, tmp_path):
    _, objects = rendered
    for workload_ in tessera_workloads(objects):
        pod, container_ = workload_["spec"]["template"]["spec"], container(workload_)
        name = workload_["metadata"]["name"]
        probes = {kind: container_[f"{kind}Probe"]["httpGet"] for kind in ("startup", "liveness", "readiness")}
        assert probes["liveness"]["path"] == "/healthz" and probes["readiness"]["path"] == "/readyz", name
        for probe in probes.values():
            port(container_, probe["port"])
        grace = pod["terminationGracePeriodSeconds"]
        config = load_role(objects, workload_, tmp_path)
        if isinstance(config, ProxyConfig):
            # The drain, then uvicorn's graceful shutdown of drain_timeout_s + 1 (proxy/main.py).
            needed = 2 * config.drain_timeout_s + 1 + PROCESS_EXIT_S
            assert grace >= needed, f"{name}: grace {grace}s < drain, uvicorn's shutdown and exit ({needed}s)"
        else:
            needed = config.drain_timeout_s + WORKER_GOODBYE_S + PROCESS_EXIT_S
            assert grace >= needed, f"{name}: grace {grace}s < drain, goodbye and exit ({needed}s)"


def test_engine_settings_fit_the_pods_resources(rendered, tmp_path):
    _, objects = rendered
    for role in WORKER_ROLES:
        deployment = one(objects, "Deployment", f"tessera-{role}")
        engine = load_role(objects, deployment, tmp_path).engine
        resources = container(deployment)["resources"]
        assert engine.num_threads <= float(resources["requests"]["cpu"]), "one torch thread per requested core"
        gpus = int(resources["limits"].get("nvidia.com/gpu", 0))
        if container(deployment)["image"].endswith("-cuda"):
            assert (engine.device, engine.dtype, gpus) == ("cuda", "bfloat16", 1)
            # Several replicas, unless an autoscaler owns the count.
            assert deployment["spec"].get("replicas", 2) > 1
        else:
            assert (engine.device, gpus) == ("cpu", 0)
            assert _memory_bytes(resources["limits"]["memory"]) > engine.kv_cache_memory_bytes


def test_the_model_the_configs_name_is_in_the_image_or_on_a_mounted_volume(rendered, tmp_path):
    """No pod can prepare a model: the root file system is read-only. The embedded model must be in the image, in
    the dtype the config runs; a model directory must lie on a volume the pod mounts."""
    _, objects = rendered
    for workload_ in tessera_workloads(objects):
        name, container_ = workload_["metadata"]["name"], container(workload_)
        config = load_role(objects, workload_, tmp_path)
        model = config if isinstance(config, ProxyConfig) else config.engine
        if model.model == "embedded":
            variant = container_["image"].rsplit("-", 1)[1]
            dockerfile = (K8S.parent / "docker" / f"Dockerfile.{variant}").read_text()
            prepared = re.search(r"^ARG MODEL_DTYPES=(.+)$", dockerfile, re.M).group(1).strip('"').split()
            assert model.dtype in prepared, f"{name}: {model.dtype} is not among {prepared}"
            continue
        (mount,) = [m for m in container_["volumeMounts"] if Path(model.model).is_relative_to(m["mountPath"])]
        assert mount.get("readOnly") is True, f"{name}: the model volume is mounted read-write"
        (volume,) = [v for v in workload_["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]]
        claim = one(objects, "PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])
        assert claim["metadata"]["namespace"] == workload_["metadata"]["namespace"]


def _memory_bytes(quantity: str) -> int:
    number, unit = re.fullmatch(r"(\d+)(Mi|Gi)", quantity).groups()
    return int(number) << {"Mi": 20, "Gi": 30}[unit]
