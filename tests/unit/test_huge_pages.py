"""The huge-page arena the weights in panels live in (common/engine/huge_pages.py), and the smaps reading that
reports it."""
from __future__ import annotations

import gc

import pytest
import torch

from common.engine.huge_pages import (ALIGN_BYTES, HUGE_PAGE_BYTES, HugePageArena, mapping_fields, mapping_lines,
                                      thp_policy)
from common.engine.models.llama import LlamaForCausalLM, panels_of, panels_shape


def mapping_flags(address: int, smaps=None) -> set[str]:
    """The ``VmFlags`` of the mapping that holds ``address``; empty where smaps gives none."""
    lines = mapping_lines(address, smaps) if smaps is not None else mapping_lines(address)
    return next((set(line.split()[1:]) for line in lines if line.startswith("VmFlags:")), set())


def test_tensors_are_carved_in_order_4kb_apart_from_a_2mb_boundary_and_outlive_the_arena():
    sizes = [3 * 5 * 4, 1 << 20, 4096 * 2]
    arena = HugePageArena(HugePageArena.span(sizes))
    a = arena.take((3, 5), torch.float32)
    b = arena.take((1 << 19,), torch.bfloat16)
    c = arena.take((4096,), torch.int16)
    assert a.data_ptr() % HUGE_PAGE_BYTES == 0 and a.data_ptr() == arena.address()
    assert b.data_ptr() - a.data_ptr() == ALIGN_BYTES and c.data_ptr() - b.data_ptr() == 1 << 20
    for i, t in enumerate((a, b, c)):
        assert t.is_contiguous()
        t.fill_(i + 1)
    with pytest.raises(ValueError, match="holds"):
        arena.take((1,), torch.int8)
    del arena
    gc.collect()
    assert a.sum().item() == 15 and b.float().sum().item() == 2 * (1 << 19) and c.sum().item() == 3 * 4096


def test_the_mapping_of_an_address_is_read_from_smaps(tmp_path):
    smaps = tmp_path / "smaps"
    smaps.write_text(
        "00400000-00452000 r-xp 00000000 08:02 173521      /usr/bin/dbus-daemon\n"
        "Size:                328 kB\nAnonHugePages:         0 kB\nTHPeligible:    0\nVmFlags: rd ex mr mw me dw\n"
        "7f0000000000-7f0000600000 rw-p 00000000 00:00 0 \n"
        "Size:               6144 kB\nRss:                4096 kB\nAnonHugePages:      4096 kB\n"
        "THPeligible:    1\nVmFlags: rd wr mr mw me ac hg\n"
        "7f0000600000-7f0000601000 rw-p 00000000 00:00 0 \nSize:                  4 kB\n")
    fields = mapping_fields(0x7f0000200000, smaps)
    assert fields == {"Size": 6144 << 10, "Rss": 4096 << 10, "AnonHugePages": 4096 << 10, "THPeligible": 1}
    assert mapping_fields(0x7f0000600000, smaps) == {"Size": 4096}
    assert mapping_fields(0x10, smaps) == {} and mapping_fields(0x10, tmp_path / "none") == {}
    assert mapping_flags(0x7f0000200000, smaps) == {"rd", "wr", "mr", "mw", "me", "ac", "hg"}
    assert mapping_flags(0x7f0000600000, smaps) == set() and mapping_flags(0x400000, smaps) >= {"ex"}


def test_the_arena_is_advised_into_huge_pages_where_the_kernel_has_them():
    policy = thp_policy()
    if policy not in ("always", "madvise"):
        pytest.skip(f"transparent huge pages here: {policy}")
    arena = HugePageArena(4 * HUGE_PAGE_BYTES)
    arena.take((4 * HUGE_PAGE_BYTES,), torch.uint8).fill_(1)
    fields = mapping_fields(arena.address())
    if "THPeligible" not in fields:
        pytest.skip(f"this kernel's smaps says nothing of eligibility: {sorted(fields)}")
    # eligible, not necessarily granted: the kernel falls back to 4 KB pages where it finds no free 2 MB
    assert fields.get("Size", 0) >= 4 * HUGE_PAGE_BYTES and fields["THPeligible"] == 1


def test_panels_written_into_given_memory_equal_the_contiguous_layout():
    weight = torch.randn(48, 36).to(torch.bfloat16)
    arena = HugePageArena(weight.nbytes)
    out = panels_of(weight, arena.take(panels_shape(weight), weight.dtype))
    assert out.data_ptr() == arena.address() and torch.equal(out, panels_of(weight))


def test_a_models_panels_all_live_in_its_arena(tiny_chat_model_dir):
    from common.config.base import EngineConfig
    from common.engine.model_runner import ModelRunner
    runner = ModelRunner(EngineConfig(model=str(tiny_chat_model_dir), dtype="bfloat16", num_kv_blocks=16),
                         tiny_chat_model_dir)
    model: LlamaForCausalLM = runner.model
    if model.panel_arena is None:
        pytest.skip("the weights take no panels on this CPU (no AVX512-BF16) or dtype")
    start, end = model.panel_arena.address(), model.panel_arena.address() + model.panel_arena.nbytes
    panels = [m.panels for m in model.panel_layers()]
    assert panels and all(start <= p.data_ptr() and p.data_ptr() + p.nbytes <= end for p in panels)


@pytest.mark.parametrize("huge_pages", [True, False])
def test_engine_cpu_huge_pages_advises_the_pool_and_the_panels_in_or_out(tiny_chat_model_dir, huge_pages, caplog):
    from common.config.base import CpuConfig, EngineConfig
    from common.engine.model_runner import ModelRunner

    if thp_policy() == "unavailable":
        pytest.skip("this kernel has no transparent huge pages: no advice to give")
    caplog.set_level("INFO")
    runner = ModelRunner(EngineConfig(model=str(tiny_chat_model_dir), dtype="bfloat16", num_kv_blocks=64,
                                      cpu=CpuConfig(huge_pages=huge_pages)), tiny_chat_model_dir)
    arenas = {"the KV pool": runner.kv_cache.pool.data_ptr()}
    if runner.model.panel_arena is not None:  # the weights take panels here (AVX512-BF16)
        arenas["the panels"] = runner.model.panel_arena.address()
    for name, address in arenas.items():
        flags = mapping_flags(address)
        if not flags:
            pytest.skip(f"this kernel's smaps gives no VmFlags for {name}")
        assert ("hg" if huge_pages else "nh") in flags, (name, flags)  # advised into huge pages, or out of them
    loaded = [r.getMessage() for r in caplog.records if r.getMessage().startswith("model loaded")]
    assert len(loaded) == 1
    assert ("MiB of it in 2 MB pages" if huge_pages else "in 4 KB pages (engine.cpu.huge_pages)") in loaded[0]


def test_the_benchmark_writes_a_row_per_batch_size(tiny_chat_model_dir, capsys, monkeypatch):
    import bench.huge_pages

    monkeypatch.setattr(bench.huge_pages, "read_bandwidth", lambda passes: 50e9)  # its table, not this host's memory
    args = ["--model", str(tiny_chat_model_dir), "--rows", "1,3", "--steps", "4", "--window", "2"]
    assert bench.huge_pages.main(args) == 0
    out = capsys.readouterr().out
    if "no panels" in out:
        pytest.skip("the weights take no panels on this CPU (no AVX512-BF16)")
    rows = [line for line in out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [line.split(" | ")[0] for line in rows] == ["| 1", "| 3"]
    assert rows[0].split(" | ")[4] == "50.0-50.0" and "×" in rows[0].split(" | ")[5]


def test_a_mapping_the_kernel_refuses_leaves_the_panels_in_torchs_memory(tiny_chat_model_dir, monkeypatch, caplog):
    from common.config.base import EngineConfig
    from common.engine.model_runner import ModelRunner

    def refused(self, nbytes, huge=True):
        raise OSError(12, "Cannot allocate memory")  # what mmap says under vm.overcommit_memory=2 past the limit

    monkeypatch.setattr(HugePageArena, "__init__", refused)
    runner = ModelRunner(EngineConfig(model=str(tiny_chat_model_dir), dtype="bfloat16", num_kv_blocks=16),
                         tiny_chat_model_dir)
    model: LlamaForCausalLM = runner.model
    assert runner.kv_cache.pool.is_contiguous()  # the pool in torch's memory too (the load's timed steps wrote it)
    assert any("KV pool stays in torch's memory" in r.getMessage() for r in caplog.records)
    panels = [getattr(m, "panels", None) for m in model.panel_layers()]
    if not any(p is not None for p in panels):
        pytest.skip("the weights take no panels on this CPU (no AVX512-BF16) or dtype")
    assert model.panel_arena is None and all(p is not None and p.is_contiguous() for p in panels)
    assert any("stay in 4 KB pages" in r.getMessage() for r in caplog.records)


def test_a_one_rank_cpu_kv_pool_is_zeroed_in_an_arena_advised_into_huge_pages():
    from common.engine.kv_cache import KVCache, KVLayout, new_pool

    layout = KVLayout(num_layers=2, block_size=16, num_kv_heads=2, head_dim=64, dtype="bfloat16")
    cache = KVCache(layout, 256)  # 4 MiB: a whole 2 MiB range inside the mapping, wherever it lands
    assert cache.pool.shape == (1, 256, 2, 2, 16, 2, 64) and cache.pool.dtype == torch.bfloat16
    assert cache.pool.is_contiguous() and cache.pool.data_ptr() % HUGE_PAGE_BYTES == 0
    assert not cache.pool.any()
    fields = mapping_fields(cache.pool.data_ptr())
    if "Rss" in fields:  # zeroed at once: every page faulted in now, not in a serving step
        assert fields["Rss"] >= cache.nbytes
    if thp_policy() in ("always", "madvise") and "THPeligible" in fields:
        assert fields["THPeligible"] == 1
    # a mapping of its own (its last page a guard), so its smaps count is the pool's
    assert fields.get("Size", 0) <= cache.nbytes + HUGE_PAGE_BYTES + ALIGN_BYTES
    assert cache.huge_page_bytes() is not None
    small = new_pool((1, 64, 2, 2, 16, 2, 64), torch.bfloat16, "cpu", huge=False)
    if "THPeligible" in mapping_fields(small.data_ptr()):
        assert mapping_fields(small.data_ptr())["THPeligible"] == 0
    # a pool the ranks share stays torch's own memory, which share_memory_ moves
    shared = KVCache(KVLayout(num_layers=2, block_size=16, num_kv_heads=2, head_dim=64, dtype="bfloat16",
                              tp_size=2), 8)
    assert shared.share().is_shared() and not shared.pool.any()


@pytest.mark.parametrize("advice", ["populate", "refused"])
def test_a_zeroed_take_is_zeros_and_resident_either_way(advice, monkeypatch):
    """The kernel's populate faults a fresh arena's pages in as zeros; where it refuses the advice (an older
    kernel), ``zero_`` writes them."""
    from common.engine import huge_pages

    if advice == "refused":
        monkeypatch.setattr(huge_pages, "MADV_POPULATE_WRITE", -1)  # EINVAL, as a kernel before 5.14 answers
    arena = HugePageArena(8 << 20, huge=False)
    arena.take((4096,), torch.uint8)
    tensor = arena.take_zeroed((1 << 20,), torch.float32)
    assert not tensor.any()
    fields = mapping_fields(tensor.data_ptr())
    if "Rss" in fields:
        assert fields["Rss"] >= tensor.nbytes


def test_the_kv_pages_benchmark_gives_both_pools_the_same_output(capsys):
    import bench.kv_pages

    assert bench.kv_pages.main(["--model", "tiny", "--cases", "3x40,2x17", "--rounds", "1", "--spread", "2"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [line.split(" | ")[0] for line in rows] == ["| 3 x 40", "| 2 x 17"]
    assert all(line.rstrip(" |").endswith("True") for line in rows)


def test_the_load_line_says_how_much_of_the_kv_pool_is_in_huge_pages(tiny_chat_model_dir, caplog):
    import logging

    from common.config.base import EngineConfig
    from common.engine.model_runner import ModelRunner

    with caplog.at_level(logging.INFO, logger="common.engine.model_runner"):
        runner = ModelRunner(EngineConfig(model=str(tiny_chat_model_dir), dtype="bfloat16", num_kv_blocks=16),
                             tiny_chat_model_dir)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("model loaded"))
    huge = runner.kv_cache.huge_page_bytes()  # the arena is a mapping of its own: its count is the pool's
    assert huge is not None and 0 <= huge <= runner.kv_cache.nbytes
    assert f"{huge / 2**20:.0f} MiB of it in 2 MB pages" in line


def test_the_fault_in_benchmark_gives_both_ways_for_memory_and_an_engine(tiny_chat_model_dir, capsys):
    import bench.page_faults

    assert bench.page_faults.main(["--mib", "8", "--rounds", "2", "--model", str(tiny_chat_model_dir),
                                   "--kv-mib", "8", "--settle-s", "0"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| 2 MB pages") or line.startswith("| 4 KB pages")]
    assert len(rows) == 5 and all(len(line.split(" | ")) == 4 for line in rows)  # and 4 KB pages zeroed by writes
    assert "CPU time, 2 MB / 4 KB pages:" in out and "load CPU time, 2 MB / 4 KB pages:" in out
    assert "CPU time in 4 KB pages, populated / zeroed by writes:" in out
