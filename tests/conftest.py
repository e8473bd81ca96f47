"""Fixtures shared by every test directory, and the three lanes ``make test`` runs side by side."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from common.storage.model_store import resolve_model

# ``make test`` runs the suite in three lanes at once (pytest -n 3: xdist's three workers, each given one lane by the
# scheduler below, which keeps a lane's tests in the order of a plain run). The "compute" lane runs, one after
# another, the tests that run the embedded model for most of their time: the e2e tests whose model workers compute,
# and the unit modules named in COMPUTE_UNIT. A decode step streams the model's weights from memory, so two of
# these side by side would only share the memory bandwidth and the cores, each taking twice as long. The "beside"
# lane runs the rest, which mostly computes little: the other unit tests, and the e2e tests named in BESIDE_E2E,
# whose workers are scripted (tests/scripted_worker.py) or run a tiny model or a few short requests. The "waits"
# lane runs the tests named in WAITS, which sleep through most of their time (an idle cluster's timers, KV pulls
# held back on purpose, a hung step's watchdog): on 2 cores they cost the other lanes little, and a lane of their
# own takes their waiting off the critical path. A new e2e module goes to the compute lane unless it is named
# here; a new unit module to the beside lane. The run is as long as its CPU-seconds, both cores busy nearly
# throughout, so a lane more would gain only the sleeping; tests/cpu_report.py counts them per test and module, and
# each lane's tests' wall time shows how even the lanes are. Tests that wait but also compute (rolling upgrade,
# failover, a cut link, fuzzing) made the run longer in the waits lane (their clusters contend with the compute
# lane's for the cores): it holds the tests whose clusters are idle, scripted or tiny. Measured (2026-12-06, 2,254
# tests, `TESSERA_CPU_REPORT=DIR make test PYTEST_ARGS="-p tests.cpu_report"`): 983 s on 1,790 CPU-s, the compute
# lane's tests 932 s of wall time, the beside lane's 968, the waits lane's 566 (2,124 CPU-s and 1,200 s at 45528d2,
# before the tests' workers and engines took 4 KB pages, engine.cpu.huge_pages; 891 s on 1,591 CPU-s on 2026-12-05).
# Those runs were on an Intel Xeon with AMX. On an AMD EPYC (Zen 3, no AVX-512), whose kernels are slower: 1,417 s on
# 2,518 CPU-s (2026-12-06, e96c6ea), then 875 s on 1,575 CPU-s (2026-12-07, the lanes' tests 835, 846 and 617 s) once
# most e2e clusters served the short model (``short_model_dir``) instead of the embedded one. The same host later ran
# a run up to 17% slower than the one before it with no more work (docs/benchmarks.md, "The test suite on two
# cores", and its history): 1,011 s on 1,813 CPU-s at dd9193f (the lanes' tests 986, 954 and 771 s), once the
# worker servers preloaded float32 models (tests/fork_server.py) and WAITS' last four modules came from the beside
# lane, then its longest.
BESIDE_E2E = {
    # scripted workers behind a proxy in a thread or a torch-free process
    "test_config_reload.py", "test_metering_file.py", "test_proxy_tls.py", "test_recovery_phases.py",
    "test_request_logs.py", "test_status_command.py",
    # mostly scripted or tiny-model workers, and a few short requests through a real cluster
    "test_nonfinite_logits.py",
    # the embedded model, computing little while others run
    "test_role_switch.py", "test_protocol_versions.py", "test_planner_cluster.py",
    # processes of the tiny models' signal tests, and of `tessera generate`: each starts, answers a little, exits
    "test_worker_signals.py", "test_generate_command.py",
    # four small clusters with a worker at tensor parallelism 3 and one of tiny models at TP 2 (about 120 s alone;
    # under the compute lane's load each TP step's 61 all-reduces wait on the scheduler, so it keeps few decode
    # steps: 16 to 40 tokens)
    "test_tensor_parallel.py",
}
WAITS = {
    # two clusters of a tiny model whose KV pulls are held back 20 s (testing.fault_kv_pull_delay_s)
    "test_stranded_pages.py",
    # a step hung on purpose until the watchdog's periods pass
    "test_watchdog.py",
    # scripted workers (no model) behind proxies waiting on drains, sessions and a Redis they share
    "test_admin_api.py", "test_proxies_shared.py",
    # scripted or simulated workers whose tests wait on tenants' timers, stream windows and role switches (alone:
    # tenants 89 s of wall time for 9 s of CPU, the conversation store 15 for 5, takeovers 18 for 4, the simulated
    # worker 17 for 5)
    "test_tenants.py", "test_conversation_store.py", "test_stream_takeover.py", "test_sim_worker.py",
    # an idle cluster for many heartbeat timeouts; in this lane its module's cluster fixture starts one of its own
    "test_fault_scenarios.py::test_an_idle_cluster_then_a_burst",
    # scripted or tiny-model workers that wait on timeouts, reconnects and restarts far longer than they compute
    # (in the beside lane, 2026-12-02: 197 s of wall time for 75 CPU-s, the beside lane then the run's longest)
    "test_proxy_api.py", "test_proxy_failures.py", "test_proxy_limits.py", "test_proxy_migration.py",
    "test_curve_security.py", "test_frame_fuzz.py", "test_hot_cold_models.py", "test_kv_transfer_processes.py",
    "test_prometheus_scrape.py", "test_resumable_streams.py", "test_websocket_stream.py",
    # clusters that serve a few short requests between waits on registration, streams' credit and sessions' expiry
    # (in the beside lane, 2026-12-07: 153 s of wall time for 83 CPU-s, the beside lane then the run's longest at
    # 1,035 s and the waits lane done after 677)
    "test_worker_tokenizer.py", "test_sessions.py", "test_embeddings.py", "test_grpc_api.py",
}
COMPUTE_UNIT = {
    "test_embedder.py", "test_engine_embedded.py", "test_engine_resume.py", "test_fused_decode.py",
    "test_spec_decode.py",
}


def lane(nodeid: str) -> str:
    path, _, name = nodeid.partition("::")
    test_file = Path(path)
    if test_file.parent.name != "e2e":
        return "compute" if test_file.name in COMPUTE_UNIT else "beside"
    named = {test_file.name, f"{test_file.name}::{name.partition('[')[0]}"}
    return "waits" if named & WAITS else "beside" if named & BESIDE_E2E else "compute"


def pytest_configure(config) -> None:
    """Each test process forks its clusters' processes from fork servers (tests/fork_server.py: 2.3 CPU-s less per
    worker, 1 per proxy).

    Each lane's clusters pick their ports from a band of their own (``free_port``), below the ephemeral range.

    And each lane computes on one thread (torch in the lane's own process, and the processes it starts that do not
    set ``engine.num_threads``): three lanes already keep both cores busy, and a second OpenMP thread only spins
    for a core another lane holds (tests/unit/test_engine_embedded.py alone: 50 CPU-s at 2 threads, 33 at 1, for
    26 s of wall time against 30). A test whose engine or benchmark sets its own thread count (``engine.num_threads``
    sets torch's for the whole process) has it set back after it (``one_thread_per_lane``)."""
    from common.cli.local_cluster import LocalCluster
    from tests import fork_server

    LocalCluster.launch = staticmethod(fork_server.spawn)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    if worker.startswith("gw") and count > 1:
        width = (32000 - 10000) // count
        start = 10000 + int(worker[2:]) * width
        os.environ["TESSERA_FREE_PORTS"] = f"{start}-{start + width}"
        os.environ["OMP_NUM_THREADS"] = "1"
        import torch

        torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def one_thread_per_lane():
    """In a lane, torch back on one thread after each test: the in-process benchmarks' engines (bench/huge_pages.py,
    bench/offline.py) set two, and every later test of that lane then ran its model steps with a second OpenMP thread
    spinning for a core the other lanes hold (tests/unit/test_spec_embedded.py: 42 CPU-s in 22 s of wall time, and
    31 in 32 on one thread)."""
    yield
    if os.environ.get("OMP_NUM_THREADS") == "1" and os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        if torch.get_num_threads() != 1:
            torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def int8_ranges_of_the_test(tmp_path_factory, monkeypatch):
    """The int8 calibration's cache (common/engine/int8_ranges.py) in this session's temporary directory, not the
    user's, so the suite's many temporary models never push a developer's entries out; a test's int8 runner measures
    its ranges unless an earlier test of its lane measured the same model's. Processes a test starts (workers, the
    tensor-parallel ranks past 0) keep the user's cache."""
    from common.engine import int8_ranges

    root = tmp_path_factory.getbasetemp() / "int8-ranges-cache"
    monkeypatch.setattr(int8_ranges, "default_cache_root", lambda: root)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under xdist, each lane is one unit of work, run in collection order by one worker."""
    from xdist.scheduler import LoadScopeScheduling

    class Lanes(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return lane(nodeid)

    return Lanes(config, log)


@pytest.fixture(scope="session")
def embedded_model_dir() -> Path:
    """The embedded SmolLM2-135M-Instruct in float32, prepared in the default cache on first use."""
    return resolve_model("embedded", "float32")


@pytest.fixture(scope="session")
def embedded_model_dir_bf16() -> Path:
    """The embedded SmolLM2-135M-Instruct in bfloat16, prepared in the default cache on first use."""
    return resolve_model("embedded", "bfloat16")


@pytest.fixture(scope="session")
def tiny_chat_model_dir(tmp_path_factory, request) -> Path:
    """A tiny random Llama with the embedded model's tokenizer: the whole engine in milliseconds. Where the
    embedded model cannot be prepared (the device check's machine, which has no network), TESSERA_TEST_TOKENIZER
    names a model directory to take the same tokenizer from."""
    from tests.tiny_models import build_tiny_model

    return build_tiny_model("llama", tmp_path_factory.mktemp("tiny-chat"), tokenizer_from=tokenizer_source(request))


@pytest.fixture(scope="session")
def short_model_dir(tmp_path_factory, request) -> Path:
    """The embedded model's shape in 4 layers of random weights, with its tokenizer (tests/tiny_models.py
    ``build_short_model``), in float32: what the e2e tests of streams, faults and processes serve.
    TESSERA_TEST_TOKENIZER as for ``tiny_chat_model_dir``."""
    from tests.tiny_models import build_short_model

    return build_short_model(tmp_path_factory.mktemp("short-model"), tokenizer_from=tokenizer_source(request))


def tokenizer_source(request) -> Path:
    """The model directory a test model takes its tokenizer from: TESSERA_TEST_TOKENIZER, else the embedded model."""
    tokenizer = os.environ.get("TESSERA_TEST_TOKENIZER")
    return Path(tokenizer) if tokenizer else request.getfixturevalue("embedded_model_dir")
