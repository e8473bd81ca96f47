"""Tessera's NetworkPolicies admit exactly the traffic its manifests and role configs use.

Every layout of tests/k8s_layouts.py is rendered and its NetworkPolicies are evaluated here as the API defines them:
a pod that policies of a direction select admits, in that direction, only what one of their rules admits; a pod no
policy selects admits everything. The peers: every workload of the layout, Prometheus in the namespace
"monitoring", the cluster's DNS, a pod of another namespace, a pod of Tessera's namespace that is not Tessera's,
and an address outside the cluster. The ports: every port a container declares, DNS's, and one that none declares
(where KV transfers listen: ports the OS picks).

The flows Tessera needs are derived from the rendered objects and the role configs they load: clients (anyone) to
the proxy's HTTP port; workers to the proxy's worker_bind port; workers to workers on every TCP port (KV pulls go
to the pod IP, transfer_host); the proxy to each worker's kv_events_port (its prefix index's KV events); Prometheus to each pod's prometheus.io/port; workers to DNS (proxy_address names a
host); proxies to the Redis of shared_state.redis_url. Into every pod of the namespace, and out of every pod whose
egress is restricted, what the policies admit must equal those flows; every flow must pass both ends; and every
port a container declares must belong to a flow.
"""
from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from common.runtime.proxy_links import proxy_addresses
from tests.k8s_layouts import (LAYOUT_IDS, LAYOUTS, component, container, load_role, one, pod_labels, port, render,
                               selects, tessera_workloads, workloads)

NAMESPACE = "tessera"
MONITORING = "monitoring"
EPHEMERAL_PORT = 41234  # a port no container declares: where a KV transfer server may listen
ANY_TCP = None  # a flow's port: every TCP port
ANYONE = "*"  # a flow's source: any client, that is any peer whose egress is open


@dataclass(frozen=True)
class Peer:
    name: str
    ip: str
    namespace: str | None = None  # None: outside the cluster
    labels: dict = field(default_factory=dict, hash=False)
    ports: dict = field(default_factory=dict, hash=False)  # port name -> number, for named ports in rules

    def namespace_labels(self) -> dict:
        return {"kubernetes.io/metadata.name": self.namespace}


@dataclass(frozen=True)
class Flow:
    source: str
    destination: str
    port: int | None  # ANY_TCP: every TCP port
    protocol: str = "TCP"


@pytest.fixture(scope="module", params=LAYOUTS, ids=LAYOUT_IDS)
def layout(request, tmp_path_factory):
    objects = render(*request.param)
    peers = _peers(objects)
    return objects, peers, _needed_flows(objects, peers, tmp_path_factory.mktemp("configs"))


def _peers(objects: list[dict]) -> dict[str, Peer]:
    own = [Peer(w["metadata"]["name"], f"10.42.0.{i + 10}", NAMESPACE, pod_labels(w),
                {p["name"]: p["containerPort"] for p in container(w).get("ports", [])})
           for i, w in enumerate(workloads(objects))]
    others = [
        Peer("prometheus", "10.42.9.1", MONITORING, {"app.kubernetes.io/name": "prometheus"}),
        Peer("kube-dns", "10.42.9.2", "kube-system", {"k8s-app": "kube-dns"}, {"dns": 53, "dns-tcp": 53}),
        Peer("client-elsewhere", "10.42.9.3", "default", {"app": "client"}),
        Peer("stranger-in-namespace", "10.42.9.4", NAMESPACE, {"app": "debug"}),
        Peer("outside", "203.0.113.7"),
    ]
    return {peer.name: peer for peer in own + others}


def _needed_flows(objects: list[dict], peers: dict[str, Peer], tmp_path: Path) -> set[Flow]:
    (proxy,) = [w for w in tessera_workloads(objects) if component(w) == "proxy"]
    proxy_config = load_role(objects, proxy, tmp_path)
    workers = [w for w in tessera_workloads(objects) if component(w) != "proxy"]
    proxy_name = proxy["metadata"]["name"]
    bind_port = int(proxy_config.worker_bind.rsplit(":", 1)[1])
    flows = {Flow(ANYONE, proxy_name, proxy_config.port)}  # the API
    for worker in workers:
        name = worker["metadata"]["name"]
        config = load_role(objects, worker, tmp_path)
        flows.add(Flow(name, proxy_name, bind_port))
        flows.update(Flow(name, other["metadata"]["name"], ANY_TCP) for other in workers)
        hosts = {re.fullmatch(r"tcp://([^:]+):\d+", a).group(1) for a in proxy_addresses(config.proxy_address)}
        if any(not _is_ip(host) for host in hosts):
            flows.update(Flow(name, "kube-dns", 53, protocol) for protocol in ("UDP", "TCP"))
        assert config.transfer_host != "127.0.0.1", "KV pulls come from other pods: transfer_host is the pod's IP"
        assert config.kv_events_port, "the proxies subscribe to a worker's KV events on a port the policies name"
        flows.add(Flow(proxy_name, name, config.kv_events_port))
    for workload_ in tessera_workloads(objects):
        annotations = workload_["spec"]["template"]["metadata"]["annotations"]
        flows.add(Flow("prometheus", workload_["metadata"]["name"], int(annotations["prometheus.io/port"])))
    if proxy_config.shared_state.redis_url:
        host, service_port = re.fullmatch(r"redis://([^:/]+):(\d+)/\d+", proxy_config.shared_state.redis_url).groups()
        service = one(objects, "Service", host)
        (redis,) = [w for w in workloads(objects) if selects(service["spec"]["selector"], pod_labels(w))]
        (entry,) = [p for p in service["spec"]["ports"] if p["port"] == int(service_port)]
        flows.add(Flow(proxy_name, redis["metadata"]["name"], port(container(redis), entry["targetPort"])))
    return flows


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _probes(peers: dict[str, Peer]) -> list[tuple[int, str]]:
    declared = {number for peer in peers.values() for number in peer.ports.values()}
    return sorted({(number, "TCP") for number in declared} | {(53, "UDP"), (53, "TCP"), (EPHEMERAL_PORT, "TCP")})


def _selecting(policies: list[dict], pod: Peer, direction: str) -> list[dict]:
    return [p for p in policies if p["metadata"]["namespace"] == pod.namespace
            and direction in p["spec"].get("policyTypes", ["Ingress"])
            and selects(p["spec"]["podSelector"], pod.labels)]


def _peer_matches(entries: list[dict] | None, policy_namespace: str, peer: Peer) -> bool:
    if not entries:
        return True
    for entry in entries:
        if "ipBlock" in entry:
            block = entry["ipBlock"]
            address = ipaddress.ip_address(peer.ip)
            if address in ipaddress.ip_network(block["cidr"]) and not any(
                    address in ipaddress.ip_network(cidr) for cidr in block.get("except", [])):
                return True
            continue
        if peer.namespace is None:
            continue
        if "namespaceSelector" in entry:
            in_namespace = selects(entry["namespaceSelector"], peer.namespace_labels())
        else:
            in_namespace = peer.namespace == policy_namespace
        if in_namespace and selects(entry.get("podSelector", {}), peer.labels):
            return True
    return False


def _port_matches(ports: list[dict] | None, number: int, protocol: str, destination: Peer) -> bool:
    if not ports:
        return True
    for rule in ports:
        if rule.get("protocol", "TCP") != protocol:
            continue
        if "port" not in rule:
            return True
        wanted = rule["port"]
        if isinstance(wanted, str):  # a named port: the destination container's
            if destination.ports.get(wanted) == number:
                return True
        elif wanted <= number <= rule.get("endPort", wanted):
            return True
    return False


def _admits(policies: list[dict], direction: str, pod: Peer, other: Peer, number: int, protocol: str) -> bool:
    """Whether ``pod``'s policies admit traffic to it from ``other`` (Ingress), or from it to ``other`` (Egress)."""
    selecting = _selecting(policies, pod, direction)
    if not selecting:
        return True
    rules_key, peers_key = ("ingress", "from") if direction == "Ingress" else ("egress", "to")
    destination = pod if direction == "Ingress" else other
    return any(_peer_matches(rule.get(peers_key), policy["metadata"]["namespace"], other)
               and _port_matches(rule.get("ports"), number, protocol, destination)
               for policy in selecting for rule in policy["spec"].get(rules_key, []))


def _needed(flows: set[Flow], source: str, destination: str, number: int, protocol: str, clients: bool = True) -> bool:
    """Whether ``flows`` need ``source`` to reach ``destination`` there; with ``clients``, as any client may."""
    sources = (source, ANYONE) if clients else (source,)
    return any(Flow(s, destination, number, protocol) in flows
               or (protocol == "TCP" and Flow(s, destination, ANY_TCP) in flows) for s in sources)


def _mismatches(policies: list[dict], direction: str, pairs, peers: dict[str, Peer], flows: set[Flow],
                clients: bool) -> list[str]:
    """Each (source, destination, port) of ``pairs`` whose admission by the ``direction`` policies (at the
    destination for Ingress, the source for Egress) differs from what ``flows`` need."""
    wrong = []
    for source, destination in pairs:
        pod, other = (destination, source) if direction == "Ingress" else (source, destination)
        for number, protocol in _probes(peers):
            admitted = _admits(policies, direction, pod, other, number, protocol)
            if admitted != _needed(flows, source.name, destination.name, number, protocol, clients=clients):
                wrong.append(f"{source.name} -> {destination.name}:{number}/{protocol} "
                             f"{'admitted, not needed' if admitted else 'needed, refused'}")
    return wrong


def test_into_every_pod_of_the_namespace_exactly_the_needed_flows_are_admitted(layout):
    objects, peers, flows = layout
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
    pairs = [(source, destination) for destination in peers.values() if destination.namespace == NAMESPACE
             for source in peers.values()]
    wrong = _mismatches(policies, "Ingress", pairs, peers, flows, clients=True)
    assert not wrong, "\n".join(wrong)


def test_out_of_the_pods_whose_egress_is_closed_exactly_the_needed_flows_are_admitted(layout):
    objects, peers, flows = layout
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
    closed = [p for p in peers.values() if _selecting(policies, p, "Egress")]
    # Workers hold prompts and KV pages: they may reach the proxy, each other and DNS, and nothing else.
    assert {p.name for p in closed} >= {w["metadata"]["name"] for w in tessera_workloads(objects)
                                        if component(w) != "proxy"}
    # A pod whose egress is closed is nobody's client: only the flows that name it as the source.
    wrong = _mismatches(policies, "Egress", [(s, d) for s in closed for d in peers.values()], peers, flows,
                        clients=False)
    assert not wrong, "\n".join(wrong)


def test_every_needed_flow_passes_both_ends(layout):
    objects, peers, flows = layout
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
    clients = [p for p in peers.values() if not _selecting(policies, p, "Egress")]
    for flow in flows:
        destination = peers[flow.destination]
        for source in clients if flow.source == ANYONE else [peers[flow.source]]:
            for number in [flow.port] if flow.port is not ANY_TCP else [n for n, p in _probes(peers) if p == "TCP"]:
                assert _admits(policies, "Egress", source, destination, number, flow.protocol), (source.name, flow)
                assert _admits(policies, "Ingress", destination, source, number, flow.protocol), (source.name, flow)


def test_every_declared_port_belongs_to_a_flow(layout):
    """A port added to a container without a flow (and a policy rule) for it would be refused, or open to all."""
    objects, peers, flows = layout
    for workload_ in workloads(objects):
        name = workload_["metadata"]["name"]
        targeted = {f.port for f in flows if f.destination == name}
        for declared in container(workload_).get("ports", []):
            assert declared["containerPort"] in targeted or ANY_TCP in targeted, f"{name}: {declared}"


def test_the_evaluation_itself():
    """The rules of the API the checks above lean on: no policy admits all, peers are of the policy's namespace
    unless a namespaceSelector says otherwise, named ports are the destination's, an empty rule admits all."""
    web = Peer("web", "10.0.0.1", "ns", {"app": "web"}, {"http": 80})
    db = Peer("db", "10.0.0.2", "ns", {"app": "db"}, {"sql": 5432})
    foreign = Peer("foreign", "10.0.0.3", "other", {"app": "web"})
    outside = Peer("outside", "198.51.100.1")
    assert _admits([], "Ingress", db, outside, 5432, "TCP")
    policy = {"metadata": {"namespace": "ns"}, "spec": {
        "podSelector": {"matchLabels": {"app": "db"}}, "policyTypes": ["Ingress"],
        "ingress": [{"from": [{"podSelector": {"matchExpressions": [
            {"key": "app", "operator": "In", "values": ["web"]}]}}], "ports": [{"port": "sql"}]},
                    {"from": [{"ipBlock": {"cidr": "198.51.100.0/24"}}], "ports": [{"port": 1, "endPort": 9}]}]}}
    assert _admits([policy], "Ingress", db, web, 5432, "TCP")
    assert not _admits([policy], "Ingress", db, web, 5432, "UDP")
    assert not _admits([policy], "Ingress", db, foreign, 5432, "TCP")
    assert not _admits([policy], "Ingress", db, web, 80, "TCP")
    assert _admits([policy], "Ingress", db, outside, 9, "TCP")
    assert not _admits([policy], "Ingress", db, outside, 10, "TCP")
    assert _admits([policy], "Ingress", web, db, 80, "TCP")  # web is selected by no policy
    assert _admits([policy], "Egress", db, outside, 443, "TCP")  # nor is any pod's egress
