"""The int8 calibration's cache (common/engine/int8_ranges.py): a second load reads what the first measured and
quantizes the same weights, without the calibration forward; anything that changes the ranges, or an entry that
cannot be used, measures again; two processes take turns."""
from __future__ import annotations

import fcntl
import os
import threading
import time

import pytest
import torch
from torch import nn

from common.config.base import CpuConfig, EngineConfig
from common.engine import int8_ranges
from common.engine.int8_ranges import RangesKey, cached_ranges, ranges_key
from common.engine.model_runner import ModelRunner
from common.engine.tensor_parallel import Parallel
from tests.tiny_models import build_tiny_model


@pytest.fixture
def cache_root(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setattr(int8_ranges, "default_cache_root", lambda: root)
    return root / "int8-ranges"


@pytest.fixture
def model_dir(tmp_path):
    return build_tiny_model("llama", tmp_path / "model")


def int8_runner(model_dir, **options) -> ModelRunner:
    return ModelRunner(EngineConfig(model=str(model_dir), num_kv_blocks=64, block_size=16, dtype="float32",
                                    quantization="int8", deterministic=False, **options), model_dir)


def quantized(runner: ModelRunner) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in runner.model.state_dict().items()}


def count_forwards(monkeypatch) -> list[int]:
    calls = [0]
    forward = ModelRunner._forward_prompts

    def counted(self, prompts):
        calls[0] += 1
        return forward(self, prompts)
    monkeypatch.setattr(ModelRunner, "_forward_prompts", counted)
    return calls


def test_a_second_load_reads_the_ranges_and_quantizes_the_same_weights(cache_root, model_dir, monkeypatch):
    forwards = count_forwards(monkeypatch)
    first = quantized(int8_runner(model_dir))
    assert forwards[0] > 0 and len(list(cache_root.glob("*.safetensors"))) == 1
    measured = forwards[0]
    second = quantized(int8_runner(model_dir))
    assert forwards[0] == measured  # no calibration forward
    assert first.keys() == second.keys()
    assert all(torch.equal(first[name], second[name]) for name in first)


def test_what_changes_the_ranges_measures_again(cache_root, model_dir, monkeypatch):
    forwards = count_forwards(monkeypatch)
    int8_runner(model_dir)
    for change in ({"dtype": "bfloat16"}, {"deterministic": True}, {"cpu": CpuConfig(kv_cache_dtype="int8")},
                   {"block_size": 32}):
        change.setdefault("block_size", 16)
        before = forwards[0]
        ModelRunner(EngineConfig(model=str(model_dir), num_kv_blocks=64, quantization="int8",
                                 **{"dtype": "float32", "deterministic": False, **change}), model_dir)
        assert forwards[0] > before, change
    before = forwards[0]
    weights = next(model_dir.glob("*.safetensors"))
    os.utime(weights, ns=(time.time_ns(), weights.stat().st_mtime_ns + 1_000_000_000))  # rewritten weights
    int8_runner(model_dir)
    assert forwards[0] > before
    assert len(list(cache_root.glob("*.safetensors"))) == 6


def test_the_key_covers_the_rank_and_layout(model_dir):
    def key(**change):
        return ranges_key(**{"model_dir": model_dir, "dtype": "float32", "device_type": "cpu", "attention": "torch",
                             "block_size": 16, "kv_dtype": "float32", "token_ids": [1, 2, 3], "window": 256,
                             "tp_size": 2, "rank": 0, "deterministic": False, **change})
    base = key()
    assert key().entry == base.entry
    assert key(rank=1).layout == base.layout and key(rank=1).entry != base.entry
    for change in ({"tp_size": 1}, {"window": 128}, {"token_ids": [1, 2]}, {"device_type": "cuda"},
                   {"attention": "cpu_paged"}, {"block_size": 32}, {"kv_dtype": "int8"}):
        assert key(**change).layout != base.layout, change
    assert {"cpu", "torch", "engine_source"} <= base.described.keys()
    (model_dir / "config.json").unlink()  # a directory that cannot be read: measured, without the cache
    assert key() is None


def modules(*widths) -> list[nn.Module]:
    return [nn.Linear(width, 3) for width in widths]


def key_for(name: str) -> RangesKey:
    return RangesKey(f"entry-{name}", f"layout-{name}", {"name": name})


def test_an_entry_that_does_not_fit_or_cannot_be_read_is_measured_again(tmp_path, caplog):
    layers = modules(4, 6)
    measured = [torch.arange(4.0), torch.arange(6.0)]
    key = key_for("a")
    assert cached_ranges(key, layers, lambda: measured, Parallel(), 1.0, tmp_path) is measured
    read = cached_ranges(key, layers, lambda: pytest.fail("measured again"), Parallel(), 1.0, tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(read, measured))
    # other layers' widths (a model whose files kept their names, sizes and times)
    wider = modules(4, 8)
    again = [torch.ones(4), torch.ones(8)]
    assert cached_ranges(key, wider, lambda: again, Parallel(), 1.0, tmp_path) is again
    assert "does not fit" in caplog.text
    # a torn file
    (tmp_path / "entry-a.safetensors").write_bytes(b"\x10\x00\x00\x00garbage")
    assert cached_ranges(key, wider, lambda: again, Parallel(), 1.0, tmp_path) is again
    assert "cannot be read" in caplog.text
    assert cached_ranges(key, wider, lambda: pytest.fail("measured again"), Parallel(), 1.0, tmp_path)
    # an entry that is not a file (any error reading it but its absence is logged, and measured past)
    other = key_for("dir")
    (tmp_path / f"{other.entry}.safetensors").mkdir()
    assert cached_ranges(other, wider, lambda: again, Parallel(), 1.0, tmp_path) is again
    assert f"{other.entry}.safetensors cannot be read" in caplog.text


def test_an_unwritable_cache_costs_a_calibration_not_a_load(tmp_path, caplog):
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    measured = [torch.ones(4)]
    assert cached_ranges(key_for("b"), modules(4), lambda: measured, Parallel(), 1.0, blocked / "ranges") is measured
    assert "no lock in" in caplog.text and "could not be kept" in caplog.text


def test_a_process_waits_for_another_measuring_and_reads_what_it_wrote(tmp_path, monkeypatch):
    key, layers = key_for("c"), modules(4)
    measuring, waiting = threading.Event(), threading.Event()
    lock_within = int8_ranges.lock_within

    def noticed_wait(file, wait_s):  # the second caller finds the lock held, then lets the first finish
        if wait_s == 30.0:
            if not lock_within(file, 0.0):
                waiting.set()
                return lock_within(file, wait_s)
            return True
        return lock_within(file, wait_s)
    monkeypatch.setattr(int8_ranges, "lock_within", noticed_wait)

    def slow_measure():
        measuring.set()
        assert waiting.wait(30), "the second process never waited"
        return [torch.full((4,), 2.0)]
    failed = []

    def first():
        try:
            cached_ranges(key, layers, slow_measure, Parallel(), 1.0, tmp_path)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            failed.append(exc)
    thread = threading.Thread(target=first)
    thread.start()
    assert measuring.wait(30)
    read = cached_ranges(key, layers, lambda: pytest.fail("measured twice"), Parallel(), 30.0, tmp_path)
    thread.join(30)
    assert not failed and not thread.is_alive()
    assert waiting.is_set() and torch.equal(read[0], torch.full((4,), 2.0))


def test_past_the_wait_a_process_measures_itself(tmp_path, caplog):
    key, layers = key_for("d"), modules(4)
    with open(tmp_path / f"{key.layout}.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        ones = [torch.ones(4)]
        # flock is per open file: this process's second open waits as another process's would
        assert cached_ranges(key, layers, lambda: ones, Parallel(), 0.0, tmp_path) is ones
    assert "engine.int8.calibration_wait_s" in caplog.text


def test_the_oldest_entries_and_stale_files_go(tmp_path, monkeypatch):
    monkeypatch.setattr(int8_ranges, "MAX_ENTRIES", 2)
    for i, name in enumerate("efg"):
        cached_ranges(key_for(name), modules(4), lambda: [torch.ones(4)], Parallel(), 1.0, tmp_path)
        for path in tmp_path.glob(f"*-{name}.*"):  # distinct times, whatever the file system's resolution
            os.utime(path, ns=(i * 10**9, i * 10**9))
    (tmp_path / ".entry-x.safetensors.crashed").touch()  # write_atomic's temporary files
    os.utime(tmp_path / ".entry-x.safetensors.crashed", ns=(0, 0))
    (tmp_path / ".entry-y.safetensors.writing").touch()  # another process's, now
    (tmp_path / "notes.txt").touch()  # not the cache's: kept at any age
    os.utime(tmp_path / "notes.txt", ns=(0, 0))
    cached_ranges(key_for("h"), modules(4), lambda: [torch.ones(4)], Parallel(), 1.0, tmp_path)
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == ["entry-g.safetensors", "entry-h.safetensors"]
    # lock files a day old go (e, f and g's, dated 1970), a crashed writer's leftovers too
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix != ".safetensors") == [
        ".entry-y.safetensors.writing", "layout-h.lock", "notes.txt"]
