"""Cold models, the proxy's side: which worker is asked to load a version, the 503s meanwhile, and the load's end."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from common.config.roles import ProxyConfig
from common.protocol.versions import MESSAGE_SINCE
from common.protocol.wire import PROTOCOL_VERSION, KVLayoutInfo, LoadModel, Register, Standby
from common.storage.registry import ModelRegistry
from common.text.tokenizer import Tokenizer
from proxy.core.errors import ApiError
from proxy.core.metrics import ProxyMetrics
from proxy.cluster.model_loading import ModelLoader
from proxy.cluster.served_models import ServedModels
from proxy.cluster.tokenizer_fetch import TokenizerFetcher
from proxy.core.workers import WorkerRegistry
from tests.tiny_models import build_tiny_model

LAYOUT = KVLayoutInfo(2, 16, 2, 8, "float32")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, embedded_model_dir):
    return build_tiny_model("llama", tmp_path_factory.mktemp("cold"), tokenizer_from=embedded_model_dir)


def register(worker_id: str, role: str, model: str, standby=(), epoch: int = 1, load_s: float = 0.0) -> Register:
    name, _, version = model.partition("@")
    return Register(worker_id, role, epoch, name, version, LAYOUT, 64, 512, "zmq", b"", max_num_seqs=8,
                    standby=list(standby), load_s=load_s)


class Cluster:
    """A ModelLoader and ServedModels over a real WorkerRegistry, with what the loader sends kept."""

    def __init__(self, tmp_path, own_dir, swap_min_idle_s: float = 0.0) -> None:
        self.now = 100.0
        self.config = ProxyConfig(model_load_timeout_s=60.0, heartbeat_timeout_s=10.0, served_model_name="alias",
                                  model_swap_min_idle_s=swap_min_idle_s, requests={"retry_after_s": 1},
                                  sessions={"session_pin_max_s": 60.0})
        self.registry = WorkerRegistry(self.config.heartbeat_timeout_s)
        self.sent: list[tuple[str, object]] = []
        self.busy: set[str] = set()
        self.metrics = ProxyMetrics()
        self.versions: dict[str, int] = {}
        self.loader = ModelLoader(self.config, self.registry, lambda w, m: self.sent.append((w, m)), self.metrics,
                                  [SimpleNamespace(involves=self.busy.__contains__)], self.versions,
                                  clock=lambda: self.now)
        self.store = ModelRegistry(tmp_path / "registry")
        fetcher = TokenizerFetcher(self.config, self.loader.send, self.metrics, self.versions, tmp_path / "cache")
        self.models = ServedModels(self.config, self.registry, self.store, ("tiny", "own"), Tokenizer(own_dir),
                                   own_dir, fetcher)
        self.models.loader = self.loader

    def join(self, msg: Register) -> None:
        assert self.registry.register(msg, self.now).ack.accepted
        self.versions[msg.worker_id] = PROTOCOL_VERSION
        self.loader.registered(msg)

    def stand_by(self, worker_id: str, role: str, models, error: str = "", epoch: int = 5) -> None:
        self.versions[worker_id] = PROTOCOL_VERSION
        self.loader.on_standby(Standby(worker_id, epoch, role, list(models), error), self.now)

    def refused(self, model: str) -> ApiError:
        with pytest.raises(ApiError) as raised:
            self.models.choose(model)
        return raised.value


def test_an_offered_version_is_loaded_by_an_idle_worker_and_served_once_it_registers(tmp_path, tiny_dir):
    c = Cluster(tmp_path, tiny_dir)
    c.join(register("d0", "decode", "tiny@own", standby=["other@v1"]))
    c.join(register("p0", "prefill", "tiny@own", standby=["other@v1"]))
    c.store.register(tiny_dir, "other", "v1")  # its tokenizer, for when it serves
    error = c.refused("other")
    assert error.status == 503 and "other@v1 is loading" in error.message and error.retry_after_s == 1
    assert [(w, m.model) for w, m in c.sent] == [("d0", "other@v1"), ("p0", "other@v1")]
    assert all(isinstance(m, LoadModel) for _, m in c.sent)
    assert c.registry.workers["d0"].draining and c.registry.workers["p0"].draining  # nothing more routed there
    c.refused("other@v1")  # the next request: 503 again, and no second load
    assert len(c.sent) == 2
    entry = {m["id"]: m for m in c.models.listing()}["other"]
    assert entry["loadable_versions"] == [{"version": "v1", "workers": 2, "loading": True, "last_load_s": None}]
    c.now += 3
    c.join(register("d0", "decode", "other@v1", standby=["tiny@own"], epoch=2, load_s=2.5))
    assert c.models.choose("other").key == ("other", "v1")
    assert c.loader.load_s == {"other@v1": 2.5} and "d0" not in c.loader.loading
    assert c.metrics.model_loads.labels("other@v1", "loaded")._value.get() == 1


def test_a_busy_worker_is_not_asked_and_a_worker_standing_by_is_asked_first(tmp_path, tiny_dir):
    c = Cluster(tmp_path, tiny_dir)
    c.join(register("busy", "both", "tiny@own", standby=["other@v1"]))
    c.busy.add("busy")
    error = c.refused("other@v1")
    assert error.status == 503 and "every worker that may load it is busy" in error.message and not c.sent
    c.stand_by("cold", "both", ["other@v1", "tiny@own"])
    c.refused("other@v1")
    assert [w for w, _ in c.sent] == ["cold"]


def test_a_worker_whose_model_others_serve_gives_it_up_before_the_only_one_does(tmp_path, tiny_dir):
    c = Cluster(tmp_path, tiny_dir)
    c.join(register("only", "both", "solo@v1", standby=["other@v1"]))
    c.join(register("a", "both", "tiny@own", standby=["other@v1"]))
    c.join(register("b", "both", "tiny@own"))
    c.refused("other@v1")
    assert [w for w, _ in c.sent] == ["a"]


def test_retry_after_follows_the_last_load_time_and_a_stalled_load_is_given_up(tmp_path, tiny_dir):
    c = Cluster(tmp_path, tiny_dir)
    c.loader.load_s["other@v1"] = 9.2
    c.stand_by("w", "decode", ["other@v1"])
    assert c.refused("other@v1").retry_after_s == 10
    c.now += 4
    assert c.refused("other@v1").retry_after_s == 6  # the load's time left
    c.now += 60  # past model_load_timeout_s: given up, and the worker may be asked again
    c.stand_by("w", "decode", ["other@v1"])
    c.refused("other@v1")
    assert [w for w, _ in c.sent] == ["w", "w"]
    assert c.metrics.model_loads.labels("other@v1", "failed")._value.get() == 1


def test_a_failed_load_ends_the_wait_and_a_worker_of_the_older_protocol_is_never_asked(tmp_path, tiny_dir):
    c = Cluster(tmp_path, tiny_dir)
    c.stand_by("w", "decode", ["other@v1"])
    c.refused("other@v1")
    c.stand_by("w", "decode", ["other@v1"])  # its beacon sent before it took the LoadModel: still loading
    assert "w" in c.loader.loading
    c.stand_by("w", "decode", [], error="loading other@v1 failed: OSError: no weights", epoch=6)
    assert not c.loader.loading and c.metrics.model_loads.labels("other@v1", "failed")._value.get() == 1
    assert c.refused("other@v1").message.startswith("no worker serves")  # known (offered before), not 404
    c.stand_by("old", "decode", ["other@v1"])
    c.versions["old"] = MESSAGE_SINCE["LoadModel"] - 1  # a worker from before LoadModel
    c.refused("other@v1")
    assert [w for w, _ in c.sent] == ["w"]


def test_an_unknown_model_is_404_and_an_offered_name_is_known(tmp_path, tiny_dir):
    c = Cluster(tmp_path, tiny_dir)
    with pytest.raises(ApiError) as raised:
        c.models.check("nowhere")
    assert raised.value.status == 404
    c.stand_by("w", "decode", ["other@v1"])
    c.models.check("other")
    c.models.check("other@v1")
    assert {m["id"] for m in c.models.listing()} >= {"other"}


def test_a_prefill_worker_busy_at_the_first_request_is_asked_by_a_later_one_while_the_decode_side_loads(
        tmp_path, tiny_dir):
    c = Cluster(tmp_path, tiny_dir)
    c.join(register("d0", "decode", "tiny@own", standby=["other@v1"]))
    c.join(register("p0", "prefill", "tiny@own", standby=["other@v1"]))
    c.busy.add("p0")
    c.refused("other@v1")
    assert [w for w, _ in c.sent] == ["d0"]
    c.busy.clear()
    c.refused("other@v1")
    c.refused("other@v1")
    assert [w for w, _ in c.sent] == ["d0", "p0"]  # once: its load is under way then


def test_a_worker_whose_model_was_just_chosen_keeps_it_and_a_lost_worker_ends_its_load(tmp_path, tiny_dir):
    c = Cluster(tmp_path, tiny_dir, swap_min_idle_s=5.0)
    c.join(register("w", "both", "tiny@own", standby=["other@v1"]))
    c.models.choose("tiny")  # a request for its model now
    assert "busy" in c.refused("other@v1").message and not c.sent
    c.now += 5
    c.refused("other@v1")
    assert [w for w, _ in c.sent] == ["w"]
    c.loader.forget("w")  # a Goodbye (the swap's own): the load goes on
    assert "w" in c.loader.loading
    c.loader.forget("w", lost=True)  # its connection closed: the load is over
    assert not c.loader.loading and c.metrics.model_loads.labels("other@v1", "failed")._value.get() == 1


def test_a_heartbeat_the_worker_sent_before_its_load_model_does_not_bring_it_back_into_routing():
    """Through the real Cluster: its membership applies heartbeats, the loader's mark wins until the worker
    registers again; the Standby of an unloaded worker removes what was registered under its old epoch."""
    from common.config.roles import ProxyConfig
    from common.protocol.wire import Heartbeat, encode
    from proxy.cluster.cluster import Cluster
    from proxy.core.routing import PrefixAwareRouting

    cluster = Cluster(ProxyConfig(), PrefixAwareRouting(), ProxyMetrics(), clock=lambda: 100.0)
    sent = []
    cluster.attach(lambda worker_id, msg, version: sent.append((worker_id, msg)))
    cluster.on_frames(b"d0", encode(register("d0", "decode", "tiny@own", standby=["other@v1"])))
    assert cluster.loader.want("other@v1") == 1 and isinstance(sent[-1][1], LoadModel)
    state = cluster.registry.workers["d0"]
    assert state.draining
    cluster.on_frames(b"d0", encode(Heartbeat("d0", 1, 64, 0, 0, 0, False)))  # on its way before the LoadModel
    assert state.draining
    cluster.on_frames(b"d0", encode(Standby("d0", 2, "decode", ["tiny@own", "other@v1"])))  # its load failed
    assert "d0" not in cluster.registry.workers and "d0" in cluster.loader.standing_by
