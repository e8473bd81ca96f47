"""Which model version serves a request: served versions, promotion, canary, sessions, 404 and 503."""
from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest

from common.config.roles import ProxyConfig
from common.storage.registry import ModelRegistry
from common.text.tokenizer import Tokenizer
from proxy.core.errors import ApiError
from proxy.cluster.served_models import ServedModels
from proxy.cluster.tokenizer_fetch import TokenizerFetcher
from tests.tiny_models import build_tiny_model


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory, embedded_model_dir):
    root = tmp_path_factory.mktemp("served")
    return [build_tiny_model("llama", root / f"v{i}", seed=i, tokenizer_from=embedded_model_dir) for i in (1, 2)]


def worker(worker_id: str, model: str, version: str, draining: bool = False, max_model_len: int = 512,
           decode_capable: bool = True):
    return SimpleNamespace(worker_id=worker_id, model=model, model_version=version, draining=draining,
                           max_model_len=max_model_len, tokenizer_sha256="", decode_capable=decode_capable)


class Served:
    def __init__(self, tmp_path, own_dir, *workers) -> None:
        self.store = ModelRegistry(tmp_path / "registry")
        self.workers = SimpleNamespace(workers={w.worker_id: w for w in workers})
        config = ProxyConfig(served_model_name="alias", requests={"retry_after_s": 2},
                             sessions={"session_pin_max_s": 60.0})
        fetcher = TokenizerFetcher(config, None, None, {}, tmp_path / "cache")  # the workers here report no hash
        self.models = ServedModels(config, self.workers, self.store, ("tiny", "own-digest"), Tokenizer(own_dir),
                                   own_dir, fetcher)

    def add(self, *workers) -> None:
        self.workers.workers.update({w.worker_id: w for w in workers})


def test_the_alias_and_the_name_serve_the_promoted_version_and_n_at_v_its_own(tmp_path, tiny_dirs):
    served = Served(tmp_path, tiny_dirs[0], worker("a", "tiny", "v1"), worker("b", "tiny", "v2", max_model_len=256))
    served.store.register(tiny_dirs[0], "tiny", "v1")
    served.store.register(tiny_dirs[1], "tiny", "v2")
    assert served.models.choose("tiny").key == ("tiny", "v1")  # the first registered is promoted
    assert served.models.choose("alias").key == ("tiny", "v1")
    v2 = served.models.choose("tiny@v2")
    assert v2.key == ("tiny", "v2") and v2.max_model_len == 256
    served.store.promote("tiny", "v2")
    assert served.models.choose("tiny").key == ("tiny", "v2")  # the state file changed: read again
    served.store.rollback("tiny")
    assert served.models.choose("tiny").key == ("tiny", "v1")


def test_a_canary_gets_its_share_and_a_session_always_draws_the_same(tmp_path, tiny_dirs):
    served = Served(tmp_path, tiny_dirs[0], worker("a", "tiny", "v1"), worker("b", "tiny", "v2"))
    served.store.register(tiny_dirs[0], "tiny", "v1")
    served.store.register(tiny_dirs[1], "tiny", "v2")
    served.store.promote("tiny", "v2", canary_percent=25)
    counts = Counter(served.models.choose("tiny").version for _ in range(4000))
    assert 0.21 < counts["v2"] / 4000 < 0.29
    sessions = {s: served.models.choose("tiny", session=f"s{s}").version for s in range(400)}
    assert all(served.models.choose("tiny", session=f"s{s}").version == v for s, v in sessions.items())
    assert 0.18 < sum(v == "v2" for v in sessions.values()) / 400 < 0.32
    served.store.rollback("tiny")  # the canary ends; v1 stays promoted ...
    assert {served.models.choose("tiny", session=f"new{s}").version for s in range(50)} == {"v1"}
    assert all(served.models.choose("tiny", session=f"s{s}").version == v for s, v in sessions.items())  # ... pins


def test_an_unregistered_model_serves_its_oldest_version_with_the_proxys_tokenizer(tmp_path, tiny_dirs):
    served = Served(tmp_path, tiny_dirs[0], worker("a", "tiny", "d1"), worker("b", "tiny", "d2"))
    choice = served.models.choose("alias")
    assert choice.key == ("tiny", "d1") and choice.tokenizer is served.models._own_text[0]
    served.workers.workers["a"].draining = True
    assert served.models.choose("tiny").key == ("tiny", "d2")


def test_unknown_is_404_and_known_but_unserved_is_503(tmp_path, tiny_dirs):
    served = Served(tmp_path, tiny_dirs[0])
    served.store.register(tiny_dirs[1], "other", "v1")
    with pytest.raises(ApiError) as raised:
        served.models.choose("tiny")  # the proxy's own model, before any worker registered
    assert raised.value.status == 503 and raised.value.retry_after_s == 2
    for loading in ("other", "other@v1"):
        with pytest.raises(ApiError) as raised:
            served.models.choose(loading)
        assert raised.value.status == 503 and raised.value.param == "model"
    for unknown in ("nope", "other@v7", "tiny@v7"):
        with pytest.raises(ApiError) as raised:
            served.models.choose(unknown)
        assert raised.value.status == 404 and raised.value.param == "model"
    served.add(worker("p", "other", "v1", decode_capable=False))  # its decode side still loads: not served yet
    for loading in ("other", "other@v1"):
        with pytest.raises(ApiError) as raised:
            served.models.choose(loading)
        assert raised.value.status == 503 and raised.value.code == "model_not_loaded"
    del served.workers.workers["p"]
    served.add(worker("x", "other", "v1"))
    assert served.models.choose("other").tokenizer is served.models._own_text[0]  # the same tokenizer.json
    del served.workers.workers["x"]
    served.models.served()
    with pytest.raises(ApiError) as raised:
        served.models.choose("other@v1")
    assert raised.value.status == 503


def test_versions_with_one_tokenizer_share_it(tmp_path, tiny_dirs):
    served = Served(tmp_path, tiny_dirs[0], worker("a", "tiny", "v1"), worker("b", "tiny", "v2"))
    served.store.register(tiny_dirs[0], "tiny", "v1")
    served.store.register(tiny_dirs[1], "tiny", "v2")
    assert served.models.choose("tiny@v1").tokenizer is served.models.choose("tiny@v2").tokenizer


def test_the_listing_names_versions_promotion_and_canary(tmp_path, tiny_dirs):
    served = Served(tmp_path, tiny_dirs[0], worker("a", "tiny", "v1"), worker("b", "tiny", "v2", draining=True))
    served.store.register(tiny_dirs[0], "tiny", "v1")
    served.store.register(tiny_dirs[1], "tiny", "v2")
    served.store.promote("tiny", "v2", canary_percent=10)
    alias, tiny = served.models.listing()
    assert (alias["id"], alias["root"], tiny["id"]) == ("alias", "tiny", "tiny")
    assert tiny["promoted_version"] == "v1" and tiny["canary"] == {"version": "v2", "percent": 10.0}
    assert [(v["version"], v["draining"]) for v in tiny["versions"]] == [("v1", 0), ("v2", 1)]


def test_a_session_keeps_its_version_across_a_promotion_until_its_pin_expires(tmp_path, tiny_dirs, monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr("proxy.cluster.served_models.time.monotonic", lambda: clock[0])
    served = Served(tmp_path, tiny_dirs[0], worker("a", "tiny", "v1"), worker("b", "tiny", "v2"))
    served.store.register(tiny_dirs[0], "tiny", "v1")
    served.store.register(tiny_dirs[1], "tiny", "v2")
    assert served.models.choose("tiny", session="chat").version == "v1"
    served.store.promote("tiny", "v2")
    clock[0] += 59
    kept = served.models.choose("tiny", session="chat")
    assert (kept.version, kept.moved_from) == ("v1", None)
    assert served.models.choose("tiny", session="new").version == "v2"
    assert served.models.pinned("tiny") == {"v1": 1, "v2": 1}
    clock[0] += 1  # the pin is session_pin_max_s old: the next turn moves, and says from where
    moved = served.models.choose("tiny", session="chat")
    assert (moved.version, moved.moved_from) == ("v2", "v1")
    assert served.models.pinned("tiny") == {"v2": 2}
    assert served.models.choose("tiny", session="chat").moved_from is None  # pinned to v2 now


def test_a_session_whose_version_is_no_longer_served_moves_at_once(tmp_path, tiny_dirs):
    served = Served(tmp_path, tiny_dirs[0], worker("a", "tiny", "v1"))
    served.store.register(tiny_dirs[0], "tiny", "v1")
    served.store.register(tiny_dirs[1], "tiny", "v2")
    assert served.models.choose("tiny", session="chat").version == "v1"
    served.store.promote("tiny", "v2")
    served.add(worker("b", "tiny", "v2"))
    served.workers.workers["a"].draining = True  # v1 drains: its pinned sessions cannot stay
    moved = served.models.choose("tiny", session="chat")
    assert (moved.version, moved.moved_from) == ("v2", "v1")
