"""The planner switches a real worker's role on its own when the load asks for it (issue 47), through real processes.

A proxy with the adaptive controller on (``slo.tac_enabled``, a TTFT target, the planner's shipped settings), workers
that calibrate their step costs at start as shipped (the tests' clusters otherwise skip it), one prefill and two decode
workers on the short model (tests/tiny_models.py) in float32. Eight clients send prompt-heavy requests one after another
(512-token prompts, 8 output tokens): one prefill worker cannot keep the queued prompt tokens within the TTFT target
while two decode workers idle, so the planner orders a decode worker to prefill, with no admin call. The load goes on
until eight streams sent after the switch have text. Every request served before, during and after the switch carries
the single-process engine's greedy text, no KV page is left in use, and ``/readyz`` then counts the workers the
planner's orders put in each role (2 prefill and 1 decode, unless it turned the split back).
"""
from __future__ import annotations

import asyncio
import json
import random
import time

import pytest

from common.cli.local_cluster import LocalCluster
from common.config.base import EngineConfig, StepsConfig
from common.engine.llm_engine import LLMEngine
from common.protocol.sampling_params import SamplingParams
from tests.e2e.fault_scenarios import (
    MODEL, check_nothing_lost, check_pages_freed, run_scenario, wait_until,
)

PROMPTS = 16
PROMPT_TOKENS = 512
MAX_TOKENS = 8
CLIENTS = 8
SWITCH_S = 240  # bounds the wait for the planner's order and the worker's re-registration (role_switch_timeout_s)


def prompts() -> list[list[int]]:
    rng = random.Random(4700)
    return [[rng.randrange(1000, 40000) for _ in range(PROMPT_TOKENS)] for _ in range(PROMPTS)]


@pytest.fixture(scope="module")
def reference(short_model_dir):
    engine = LLMEngine(EngineConfig(model=str(short_model_dir), dtype="float32", num_kv_blocks=1024))
    outs = engine.generate(prompts(), SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    return [o.outputs[0].text for o in outs]


@pytest.fixture(scope="module")
def cluster(short_model_dir, tmp_path_factory):
    c = LocalCluster.for_tests(
        short_model_dir, tmp_path_factory.mktemp("planner-cluster"), prefill=1, decode=2, dtype="float32",
        proxy_overrides=["slo.tac_enabled=true", "slo.ttft_slo_ms=2000"],
        role_overrides=["decode:drain_timeout_s=1"],
        worker_overrides=[f"engine.steps.calibration_s={StepsConfig().calibration_s}"]).start()  # shipped: fits at once
    yield c
    codes = c.stop()
    assert all(code == 0 for code in codes.values()), codes


def layout(cluster: LocalCluster) -> dict:
    status, ready = cluster.get("/readyz")
    return json.loads(ready)["workers"] if status == 200 else {}


def switched(run) -> bool:
    ended = run.cluster.metric("tessera_tac_planner_switches_total")
    return sum(v for k, v in ended.items() if 'outcome="done"' in k) >= 1 and layout(run.cluster)["prefill"] == 2


def served_after_the_switch(count: int):
    """Until ``count`` streams sent after the switch have text (the load goes on through the new layout); a stream
    in flight at the switch counts with those before it, whenever its text comes."""
    async def event(run) -> None:
        first = run.sent
        await wait_until(lambda run: sum(order >= first for order in run.sent_with_text) >= count,
                         f"{count} streams sent after the switch under way")(run)
    return event


def test_the_planner_moves_a_decode_worker_to_prefill_under_prompt_heavy_load(cluster, reference):
    bodies = [{"model": MODEL, "prompt": tokens, "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0.0,
               "stream": True, "stream_options": {"include_usage": True}} for tokens in prompts()]
    assert layout(cluster) == {"prefill": 1, "decode": 2, "both": 0}
    planner_switched = wait_until(switched, "the planner switched a decode worker to prefill", SWITCH_S, patient=True)
    results, _ = asyncio.run(run_scenario(cluster, bodies, [planner_switched, served_after_the_switch(CLIENTS)],
                                          steady=CLIENTS))
    check_nothing_lost(results, [_Text(t) for t in reference], bodies)
    assert len(results) >= 2 * CLIENTS  # the first CLIENTS, sent at the start, and CLIENTS sent after the switch
    # the layout is the one the planner's orders made, each done: on a loaded machine the load can go on past
    # planner.min_dwell_s after the switch, and prefill on the shared cores then slows decode past its TPOT target,
    # so the planner may turn the split back once it waited out the dwell; an order given as the load ends is
    # waited for (an idle cluster gives none: the load window empties)
    deadline, before = time.monotonic() + SWITCH_S, None
    while not ((view := planned(cluster))["settled"] and view == before) and time.monotonic() < deadline:
        before = view  # settled at two reads a second apart: no order came between one's three reads
        time.sleep(1.0)
    print(f"{len(results)} requests; {view}")
    assert view["to_prefill"] >= 1, view
    assert view["settled"], f"the planner's orders did not all end in the layout they make: {view}"
    check_pages_freed(cluster)


def planned(cluster: LocalCluster) -> dict:
    """The planner's orders by direction, the switches done, and the layout: settled once every order is done and
    the registry counts the workers each made."""
    decisions = cluster.metric("tessera_tac_planner_decisions_total")
    switches = cluster.metric("tessera_tac_planner_switches_total")
    to_prefill = int(sum(v for k, v in decisions.items() if 'direction="to_prefill"' in k))
    to_decode = int(sum(v for k, v in decisions.items() if 'direction="to_decode"' in k))
    done = int(sum(v for k, v in switches.items() if 'outcome="done"' in k))
    prefill = 1 + to_prefill - to_decode
    now = layout(cluster)
    return {"to_prefill": to_prefill, "to_decode": to_decode, "done": done, "layout": now,
            "settled": done == to_prefill + to_decode and now == {"prefill": prefill, "decode": 3 - prefill, "both": 0}}


class _Text:
    """A reference stream: only its text is compared."""

    def __init__(self, text: str) -> None:
        self.text = text
