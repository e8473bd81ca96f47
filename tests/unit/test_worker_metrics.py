"""Worker metrics and the health server: real engine numbers, served over real HTTP."""
import json
import urllib.error
import urllib.request

import pytest

from common.cli.local_cluster import free_port
from bench.loadgen.server_metrics import parse_prometheus
from common.config.base import ConfigError, EngineConfig
from common.engine.llm_engine import LLMEngine
from common.runtime.health_server import HealthServer
from common.config.roles import WorkerConfig
from common.protocol.sampling_params import SamplingParams
from common.runtime.telemetry import Snapshot, WorkerMetrics


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


class ManualClock:
    """The health check's clock, moved by the test: a stall is a count of seconds, not a sleep."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture()
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture()
def served(clock):
    config = WorkerConfig(role="decode", worker_id="d0",
                          observability={"metrics_port": free_port(), "health_stall_s": 0.5})
    metrics = WorkerMetrics(config, clock=clock)
    server = HealthServer(config, metrics).start()
    yield metrics, f"http://127.0.0.1:{server.port}"
    server.close()


@pytest.fixture(scope="module")
def engine(tiny_chat_model_dir):
    engine = LLMEngine(EngineConfig(model=str(tiny_chat_model_dir), num_kv_blocks=64, block_size=16))
    prompt = list(range(1, 70))  # four full blocks: the second run hits them in the prefix cache
    for _ in range(2):
        engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    return engine


def test_scrape_reports_the_engine_snapshot(served, engine):
    metrics, url = served
    metrics.identify("SmolLM2-135M-Instruct", "0.1.2-float32")
    metrics.publish(engine)
    status, text = get(url + "/metrics")
    assert status == 200
    values = parse_prometheus(text)
    stats, blocks = engine.stats, engine.block_manager
    assert values["tessera_worker_steps_total"] == stats.num_steps > 0
    assert values["tessera_worker_generation_tokens_total"] == stats.num_generated_tokens == 10
    # The first run stops looking at its first miss; the second finds all four blocks.
    assert values["tessera_worker_prefix_cache_queries_total"] == blocks.prefix_queries == 1 + 4
    assert values["tessera_worker_prefix_cache_hits_total"] == blocks.prefix_hits == 4
    assert values["tessera_worker_kv_pages_free"] == blocks.num_free_blocks
    assert values["tessera_worker_kv_pages_used"] + values["tessera_worker_kv_pages_free"] == 64
    assert values["tessera_worker_kv_usage_ratio"] == values["tessera_worker_kv_pages_used"] / 64
    assert values["tessera_worker_running_sequences"] == 0
    assert values["tessera_spec_decode_num_drafts_total"] == stats.num_spec_drafts
    assert ('tessera_worker_info{model="SmolLM2-135M-Instruct",role="decode",version="0.1.2-float32",'
            'worker_id="d0"} 1.0') in text


def test_event_counters_and_spec_decode_positions(served):
    metrics, url = served
    metrics.request_done("decode", "completed")
    metrics.request_done("prefill", "refused")
    metrics.kv_pulled(True, 4096, 0.02)
    metrics.kv_pulled(False, 0, 0.0)
    metrics.status.tick(Snapshot(spec_drafts=3, spec_draft_tokens=9, spec_accepted_tokens=5,
                                 spec_accepted_per_position=(3, 2, 0)))
    text = get(url + "/metrics")[1]
    values = parse_prometheus(text)
    assert 'tessera_worker_requests_total{stage="decode",status="completed"} 1.0' in text
    assert 'tessera_worker_requests_total{stage="prefill",status="refused"} 1.0' in text
    assert values["tessera_worker_kv_transfer_bytes_total"] == 4096
    assert values["tessera_worker_kv_transfer_seconds_count"] == 1
    assert values["tessera_worker_kv_transfer_failures_total"] == 1
    assert values["tessera_spec_decode_num_accepted_tokens_total"] == 5
    assert 'tessera_spec_decode_num_accepted_tokens_per_pos_total{position="1"} 2.0' in text
    assert values["tessera_spec_decode_num_accepted_tokens_per_pos_total"] == 5


def test_readiness_follows_the_worker_life_cycle(served):
    metrics, url = served

    def ready() -> tuple[int, str]:
        status, body = get(url + "/readyz")
        return status, json.loads(body)["reason"]

    assert ready() == (503, "the model is loading")
    metrics.status.model_loaded = True
    assert ready() == (503, "not registered with the proxy yet")
    metrics.status.registered = True
    assert ready() == (200, "ready")
    metrics.status.draining = True
    assert ready() == (503, "draining: no new requests")


def test_liveness_turns_503_when_the_loop_stalls(served, clock):
    metrics, url = served
    clock.now += 60
    status, body = get(url + "/healthz")
    assert status == 200 and "starting" in json.loads(body)["reason"]  # model load may take long
    metrics.status.tick()
    clock.now += 0.5
    assert get(url + "/healthz")[0] == 200
    clock.now += 0.2  # health_stall_s is 0.5
    status, body = get(url + "/healthz")
    assert status == 503 and json.loads(body)["status"] == "stalled"
    metrics.status.tick()
    assert get(url + "/healthz")[0] == 200
    assert get(url + "/nope")[0] == 404


@pytest.mark.parametrize("override, message", [
    ({"metrics_port": 70000}, "metrics_port"),
    ({"metrics_port": -1}, "metrics_port"),
    ({"metrics_host": ""}, "metrics_host"),
    ({"health_stall_s": 0}, "health_stall_s"),
    ({"otel_endpoint": "collector:4318"}, "otel_endpoint"),
])
def test_config_errors_name_the_field(override, message):
    with pytest.raises(ConfigError, match=message):
        WorkerConfig(observability=override)
