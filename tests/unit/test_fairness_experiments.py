"""The VTC paper's experiments (Sheng et al., OSDI 2024) on the proxy's real admission objects.

A discrete-time model of a disaggregated continuous-batching server drives
``AdmissionController`` (with the real queue policies, service counters and
tenant registry): each step, a prefill stage computes up to ``prefill_budget``
prompt tokens of the admitted requests in order and emits their first
tokens; a decode batch of ``decode_slots`` emits one token per running
request. Requests arrive as seeded Poisson processes. Service is measured
the way the load generator measures it, from what is emitted (prompt tokens
at the first token, ``w_out`` per generated token), independently of the
counters the policy keeps.
"""
from __future__ import annotations

import random
import statistics
from dataclasses import dataclass, field

import pytest

from common.config.roles import ProxyConfig, TenantConfig
from proxy.core.requests import Stage
from proxy.tenancy.admission import AdmissionController
from proxy.tenancy.tenants import TenantRegistry
from tests.fixed_limits import FixedLimits

W_IN, W_OUT = 1.0, 2.0


@dataclass(eq=False)
class Req:
    key: str
    tenant: str
    arrival: float
    input_len: int
    output_len: int
    prefilled: int = 0
    emitted: int = 0
    first_token_at: float | None = None


@dataclass
class Load:
    tenant: str
    rate: float  # requests per step
    start: float = 0.0
    weight: float = 1.0
    priority: str = "p1"


@dataclass
class Server:
    loads: list[Load]
    policy: str
    steps: int
    decode_slots: int = 16
    prefill_budget: int = 512
    input_len: int = 64
    output_len: int = 32
    seed: int = 0
    served: dict[str, list[float]] = field(default_factory=dict)  # cumulative weighted tokens per step
    finished: list[Req] = field(default_factory=list)
    requests: list[Req] = field(default_factory=list)
    decode_starts: list[tuple[str, dict[str, int]]] = field(default_factory=list)  # who, and who else was ready

    @property
    def vtc_bound(self) -> float:
        """2 max(w_in L_input, w_out M), M = the tokens the decode batch holds."""
        batch_tokens = self.decode_slots * (self.input_len + self.output_len)
        return 2 * max(W_IN * self.input_len, W_OUT * batch_tokens)

    def run(self) -> Server:
        config = ProxyConfig(tenancy={"fairness_policy": self.policy, "vtc_input_weight": W_IN, "vtc_output_weight": W_OUT, "max_queued_requests": 10**6, "queue_timeout_s": 10**6, "tenants": tuple(TenantConfig(load.tenant, weight=load.weight, priority=load.priority)
                          for load in self.loads)})
        tenants = TenantRegistry(config, clock=lambda: 0.0)
        prefilling: list[Req] = []
        batch: list[Req] = []

        def start_prefill(req: Req) -> bool:
            prefilling.append(req)
            return True

        def start_decode(req: Req) -> bool:
            batch.append(req)
            self.decode_starts.append((req.tenant, dict(admission.count[Stage.READY])))
            return True

        admission = AdmissionController(config, tenants)
        limits = FixedLimits(slots=self.decode_slots)

        def dispatch() -> None:
            while (admit := admission.next_admission(limits)) is not None:
                if admit.stage is Stage.PREFILLING:
                    start_prefill(admit.payload)
                    admission.prefill_started(admit.key)
                else:
                    start_decode(admit.payload)

        arrivals = self._arrivals()
        totals = {load.tenant: 0.0 for load in self.loads}
        self.served = {name: [] for name in totals}
        for step in range(self.steps):
            while arrivals and arrivals[0].arrival <= step:
                req = arrivals.pop(0)
                tenant = tenants.get(req.tenant)
                admission.check_room(tenant, 1)
                admission.enqueue(req.key, tenant, req.input_len, req)
                dispatch()
            done, ready = [], []
            for req in batch:
                req.emitted += 1
                totals[req.tenant] += W_OUT
                admission.charge_output(req.tenant, 1)
                if req.emitted == req.output_len:
                    done.append(req)
            budget = self.prefill_budget
            while prefilling and budget > 0:
                req = prefilling[0]
                chunk = min(budget, req.input_len - req.prefilled)
                req.prefilled += chunk
                budget -= chunk
                if req.prefilled == req.input_len:
                    prefilling.pop(0)
                    req.first_token_at, req.emitted = step + 1, 1
                    totals[req.tenant] += W_IN * req.input_len + W_OUT
                    admission.charge_output(req.tenant, 1)
                    ready.append(req)
            for req in done:
                batch.remove(req)
                self.finished.append(req)
                admission.leave(req.key, Stage.DECODING)
                dispatch()
            for req in ready:
                admission.ready_for_decode(req.key)
                dispatch()
            for name, total in totals.items():
                self.served[name].append(total)
        return self

    def _arrivals(self) -> list[Req]:
        rng = random.Random(self.seed)
        out = []
        for load in self.loads:
            t, n = load.start, 0
            while True:
                t += rng.expovariate(load.rate)
                if t >= self.steps:
                    break
                out.append(Req(f"{load.tenant}-{n}", load.tenant, t, self.input_len, self.output_len))
                n += 1
        self.requests = sorted(out, key=lambda r: r.arrival)
        return list(self.requests)

    def per_weight(self, tenant: str) -> list[float]:
        weight = next(load.weight for load in self.loads if load.tenant == tenant)
        return [v / weight for v in self.served[tenant]]

    def window_gap(self, a: str, b: str, start: int, end: int) -> float:
        """Largest |service(a) - service(b)| over any window [t1, t2] within [start, end), per unit weight."""
        diff = [x - y for x, y in zip(self.per_weight(a)[start:end], self.per_weight(b)[start:end])]
        return max(diff) - min(diff)

    def ttfts(self, tenant: str) -> list[float]:
        return [r.first_token_at - r.arrival for r in self.finished if r.tenant == tenant]


CAPACITY = 16 / 32  # requests per step the decode batch finishes: decode_slots / output_len
WARMUP = 100


@pytest.mark.parametrize("policy", ["vtc", "fcfs"])
def test_overload_two_tenants_four_to_one(policy):
    steps = 2000
    run = Server([Load("heavy", 4 * 0.8 * CAPACITY), Load("light", 0.8 * CAPACITY)], policy, steps).run()
    half = (WARMUP + steps) // 2
    first, second = run.window_gap("heavy", "light", WARMUP, half), run.window_gap("heavy", "light", half, steps)
    observed = run.window_gap("heavy", "light", WARMUP, steps)
    print(f"{policy}: VTC bound {run.vtc_bound:g}, observed max window gap {observed:.0f} "
          f"(first half {first:.0f}, second half {second:.0f})")
    if policy == "vtc":
        assert observed <= run.vtc_bound
        assert second <= max(first, run.vtc_bound / 4) * 1.5  # bounded, not growing with time
    else:
        assert observed > run.vtc_bound
        assert run.per_weight("heavy")[-1] - run.per_weight("light")[-1] > 1.5 * (
            run.per_weight("heavy")[half] - run.per_weight("light")[half])  # the gap keeps growing


def test_light_tenant_gets_what_it_asks_with_its_solo_ttft():
    steps = 2000
    light = Load("light", 0.1 * CAPACITY)
    alone = Server([light], "vtc", steps).run()
    shared = Server([Load("heavy", 2 * CAPACITY), light], "vtc", steps).run()
    solo, with_heavy = statistics.median(alone.ttfts("light")), statistics.median(shared.ttfts("light"))
    print(f"light tenant median TTFT: alone {solo:.2f} steps, beside a backlogged tenant {with_heavy:.2f} steps")
    assert with_heavy <= 1.5 * solo
    asked = [r for r in shared.requests if r.tenant == "light" and r.arrival < steps - WARMUP]
    assert asked and all(r.emitted == r.output_len for r in asked)  # all it asked for (but the last moments')
    assert shared.window_gap("heavy", "light", WARMUP, steps) > 0  # the heavy tenant was served the rest


def test_idle_tenant_returning_gets_half_not_everything():
    steps, back = 3000, 1500
    run = Server([Load("steady", 2 * CAPACITY), Load("returning", 2 * CAPACITY, start=back)], "vtc", steps).run()
    gained = {t: run.served[t][-1] - run.served[t][back + WARMUP] for t in run.served}
    share = gained["returning"] / sum(gained.values())
    print(f"after its return, the returning tenant got {share:.1%} of the service")
    assert 0.4 <= share <= 0.6


def test_weighted_service_one_two_three_four():
    steps = 3000
    loads = [Load(f"w{w}", 2 * CAPACITY, weight=w) for w in (1, 2, 3, 4)]
    run = Server(loads, "vtc", steps).run()
    service = {load.tenant: run.served[load.tenant][-1] - run.served[load.tenant][WARMUP] for load in loads}
    unit = service["w1"]
    ratios = {name: value / unit for name, value in service.items()}
    print("service ratio " + ":".join(f"{r:.2f}" for r in ratios.values()))
    for load in loads:
        assert ratios[load.tenant] == pytest.approx(load.weight, rel=0.10)


def test_work_conservation_single_tenant():
    steps = 2000
    fcfs = Server([Load("only", 2 * CAPACITY)], "fcfs", steps).run().served["only"][-1]
    vtc = Server([Load("only", 2 * CAPACITY)], "vtc", steps).run().served["only"][-1]
    print(f"single tenant: vtc served {vtc:.0f}, fcfs {fcfs:.0f} weighted tokens ({vtc / fcfs:.1%})")
    assert vtc >= 0.98 * fcfs


def test_higher_lane_is_always_served_first():
    steps = 1000
    run = Server([Load("batch", 2 * CAPACITY, priority="p2"), Load("interactive", 2 * CAPACITY, priority="p0")],
                 "vtc", steps).run()
    late = {t: run.served[t][-1] - run.served[t][WARMUP] for t in run.served}
    print(f"p0 tenant {late['interactive']:.0f}, p2 tenant {late['batch']:.0f} weighted tokens after warm-up")
    batch_starts = [ready for tenant, ready in run.decode_starts if tenant == "batch"]
    assert all(ready.get("interactive", 0) == 0 for ready in batch_starts)  # only slots p0 could not use
    assert late["interactive"] > 4 * late["batch"]
