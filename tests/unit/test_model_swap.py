"""Cold models, the worker's side: a real handler (two tiny models, in-process transfer backend) swapping models
when asked, unloading an idle one, standing by, and surviving a model that fails to load."""
from __future__ import annotations

import gc
import queue
import shutil
import time
import weakref

import pytest

from common.config.base import CpuConfig, EngineConfig
from common.config.roles import WorkerConfig
from common.engine.llm_engine import LLMEngine
from common.protocol import wire
from common.protocol.versions import MESSAGE_SINCE
from common.protocol.sampling_params import SamplingParams
from common.runtime.model_swap import ModelSwitch, engine_config
from common.runtime.worker_runtime import _handle, _take_messages, _turn
from decode_worker.worker import DecodeHandler
from tests.fake_transfer import FakeBackend
from tests.tiny_models import build_tiny_model

PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
PROMPT = [1, 2, 3, 4, 5, 6, 7]


class FakeIO:
    """What ModelSwitch asks of the worker's I/O thread, recorded."""

    def __init__(self) -> None:
        self.draining = False
        self.standby = None
        self.registration = None
        self.speaks = wire.PROTOCOL_VERSION
        self.events: list[str] = []
        self.inbox = queue.Queue()

    def take(self, wait_s: float = 0.0):
        return self.inbox.get(timeout=wait_s) if wait_s > 0 else self.inbox.get_nowait()

    def leave(self, reason: str) -> None:
        self.events.append(f"goodbye: {reason}")

    def rejoin(self) -> None:
        self.events.append(f"register {self.registration.model}@{self.registration.model_version}")


@pytest.fixture(scope="module")
def models(tmp_path_factory, embedded_model_dir):
    root = tmp_path_factory.mktemp("swap")
    dirs = [build_tiny_model("llama", root / name, seed=seed, tokenizer_from=embedded_model_dir)
            for name, seed in (("first", 1), ("second", 2))]
    answers = []
    for path in dirs:
        engine = LLMEngine(EngineConfig(model=str(path), num_kv_blocks=64))
        answers.append(engine.generate([PROMPT], PARAMS)[0].outputs[0].token_ids)
    assert answers[0] != answers[1]
    return dirs, answers


def worker(dirs, standby, idle_s: float = 0.0):
    engine = EngineConfig(model=str(dirs[0]), num_kv_blocks=64, block_size=16)
    config = WorkerConfig(role="both", worker_id="w0", engine=engine, observability={"metrics_port": 0},
                          standby_models=standby, model_idle_unload_s=idle_s, drain_timeout_s=5.0)
    handler = DecodeHandler(config, FakeBackend, role="both")
    sent: list = []
    handler.bind(sent.append)
    switch = ModelSwitch(config, handler, [])
    switch.io = FakeIO()
    return handler, switch, sent


def generate(handler, sent, request_id: str) -> list[int]:
    _handle(handler, wire.DecodeRequest(request_id, PROMPT, PARAMS, seed=1))
    while handler.busy():
        _turn(handler)
    deltas = [d for m in sent if isinstance(m, wire.TokenDeltas) for d in m.deltas if d.request_id == request_id]
    return [t for d in deltas for t in d.token_ids]


def test_a_load_model_drains_then_swaps_and_the_new_model_serves_its_own_output(models):
    dirs, answers = models
    handler, switch, sent = worker(dirs, [str(dirs[1])])
    first = f"{handler.model_name}@{handler.model_version}"
    second = next(k for k in switch.models if k != first)
    assert handler.registration().standby == [second] and second.startswith(f"{dirs[1].name}@")
    assert generate(handler, sent, "a") == answers[0]
    epoch, pool = handler.epoch, handler.transfer
    _handle(handler, wire.DecodeRequest("running", PROMPT, PARAMS, seed=1))  # running when the swap is asked
    switch.io.inbox.put(wire.LoadModel("w0", second))
    assert _take_messages(switch.io, handler, switch, None, 0)  # the loop hands it to the switch
    assert handler.draining and switch.io.draining and switch.check_at == 0.0
    switch.act()  # the running request first
    assert handler.engine is not None and handler.model_name == dirs[0].name
    while handler.busy():
        _turn(handler)
    switch.io.inbox.put(wire.DecodeRequest("queued", PROMPT, PARAMS, seed=1))  # routed here before the Goodbye
    sent.clear()
    switch.act()
    assert sent == [wire.RequestFailed("queued", "w0", "the worker changed its model", True)]  # not run on it
    assert switch.io.inbox.empty()
    assert switch.io.events == [f"goodbye: loading {second}", f"register {second}"]
    assert handler.model_name == dirs[1].name and handler.epoch > epoch and handler.transfer is not pool
    assert pool._closed and not handler.draining and handler.load_s > 0
    assert switch.io.registration.standby == [first] and switch.io.registration.load_s == handler.load_s
    assert generate(handler, sent, "b") == answers[1]


def test_an_idle_model_is_unloaded_and_the_worker_stands_by_until_asked_again(models):
    dirs, answers = models
    handler, switch, sent = worker(dirs, [str(dirs[1])], idle_s=30)
    own = f"{handler.model_name}@{handler.model_version}"
    assert generate(handler, sent, "a") == answers[0]
    switch.act()  # not idle long enough yet
    assert handler.engine is not None and switch.check_at == pytest.approx(handler.last_request + 30)
    handler.last_request -= 31  # its last request, as if 31 s ago
    assert gc.get_freeze_count() > 0  # what the load built is out of the collector's sight
    engine = weakref.ref(handler.engine)
    switch.act()
    assert handler.engine is None and handler.transfer is None
    assert gc.get_freeze_count() == 0 and engine() is None  # thawed, and the engine collected
    standby = switch.io.standby
    assert isinstance(standby, wire.Standby) and set(standby.models) == set(switch.models) and not standby.error
    sent.clear()
    switch.take(wire.DecodeRequest("stray", PROMPT, PARAMS, seed=1))  # routed here before the proxy knew
    assert sent == [wire.RequestFailed("stray", "w0", "this worker holds no model now (it unloaded it)", True)]
    switch.take(wire.LoadModel("w0", own))
    switch.act()
    assert switch.io.standby is None and handler.engine is not None and generate(handler, sent, "c") == answers[0]


def test_a_model_that_fails_to_load_is_dropped_and_the_worker_stands_by_with_the_error(models, tmp_path):
    dirs, _ = models
    broken = shutil.copytree(dirs[1], tmp_path / "broken")
    handler, switch, sent = worker(dirs, [str(broken)])
    key = next(k for k in switch.models if k.startswith("broken@"))
    for weights in broken.glob("*.safetensors"):
        weights.write_bytes(b"not a tensor file")
    switch.take(wire.LoadModel("w0", key))
    switch.act()
    assert handler.engine is None and key not in switch.models
    assert switch.io.standby.error.startswith(f"loading {key} failed") and switch.io.standby.models == [
        f"{dirs[0].name}@{handler.model_version}"]
    switch.take(wire.LoadModel("w0", "nowhere@v9"))  # not one of its models: ignored
    assert switch.pending is None
    handler.close()  # with no model loaded


def test_a_worker_answering_a_proxy_of_the_protocol_before_standby_keeps_its_idle_model(models):
    dirs, _ = models
    handler, switch, _ = worker(dirs, [str(dirs[1])], idle_s=30)
    switch.io.speaks = MESSAGE_SINCE["Standby"] - 1  # a proxy from before Standby
    handler.last_request -= 31
    switch.act()
    assert handler.engine is not None and switch.io.standby is None and switch.check_at == float("inf")


def test_a_prefill_worker_holds_no_compact_copy_for_steps_it_never_runs():
    auto = EngineConfig(model="x")
    assert engine_config(auto, "m2", "prefill").cpu.compact_panels == "off"
    assert engine_config(auto, "m2", "prefill").model == "m2"
    for role in ("decode", "both"):
        assert engine_config(auto, "m2", role).cpu.compact_panels == "auto"
    chosen = EngineConfig(model="x", cpu=CpuConfig(compact_panels="beside"))  # a choice of the user's stands
    assert engine_config(chosen, "m2", "prefill").cpu.compact_panels == "beside"
