"""Every C kernel builds where CI runs: without a compiler the engine falls back to torch and the kernel tests
skip, which CI must not take for a pass (.ci/run sets CI=true). Processes building the same kernel at once build
it once."""
from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import threading

import pytest

from common.engine import native
from common.engine.native import KERNEL_DIR, load_kernel

KERNELS = sorted(path.stem for path in KERNEL_DIR.glob("*.c"))


@pytest.mark.parametrize("name", KERNELS)
def test_the_kernel_builds_and_loads(name):
    if load_kernel(name) is None:
        if os.environ.get("CI"):
            pytest.fail(f"kernels/{name}.c did not build in CI: install a C compiler (gcc) with OpenMP")
        pytest.skip(f"kernels/{name}.c did not build here (no C compiler?): the engine runs its torch path")


def test_a_build_waits_while_another_process_builds_the_same_kernel(tmp_path):
    target = tmp_path / "kernel-0123.so"
    inside = threading.Event()

    def build() -> None:
        with native._build_lock(target):
            inside.set()

    with open(tmp_path / "kernel-0123.so.lock", "w") as other:  # another builder's lock (a file of its own)
        fcntl.flock(other, fcntl.LOCK_EX)
        waiter = threading.Thread(target=build)
        waiter.start()
        assert not inside.wait(0.5), "entered while another builder held the lock"
    assert inside.wait(30), "still waiting after the other builder let go"
    waiter.join()


def test_a_build_held_past_the_wait_goes_on_without_the_lock(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(native, "BUILD_WAIT_S", 0.2)
    target = tmp_path / "kernel-0123.so"
    with open(tmp_path / "kernel-0123.so.lock", "w") as other:
        fcntl.flock(other, fcntl.LOCK_EX)
        with native._build_lock(target):
            pass
    assert "BUILD_WAIT_S" in caplog.text


def test_three_processes_needing_a_kernel_on_a_fresh_cache_build_it_once(tmp_path):
    """Each process logs the compiler runs it makes; together they make one (compile and link) per kernel."""
    script = (
        "import subprocess, sys\n"
        "from common.engine import native\n"
        "real = subprocess.run\n"
        "def counted(command, **kw):\n"
        "    print('compiler run', flush=True)\n"
        "    return real(command, **kw)\n"
        "native.subprocess.run = counted\n"
        "sys.exit(0 if native.load_kernel('token_mask') is not None else 3)\n"
    )
    env = {**os.environ, "TESSERA_CACHE_DIR": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(3)]
    outputs = [proc.communicate(timeout=300)[0] for proc in procs]
    if any(proc.returncode == 3 for proc in procs):
        pytest.skip("kernels/token_mask.c did not build here (no C compiler?)")
    assert all(proc.returncode == 0 for proc in procs), outputs
    assert sum(out.count("compiler run") for out in outputs) == 2, outputs  # one compile, one link


NAMED_CALL = """
import torch
from torch.profiler import ProfilerActivity, profile
from common.engine import native
native.name_kernel_calls()
available = native.kernel_function("linear_panels", "tessera_linear_panels_available", ())
if available is None:
    raise SystemExit(3)
with profile(activities=[ProfilerActivity.CPU]) as prof:
    available()
print(sorted(event.key for event in prof.key_averages() if event.key.startswith("tessera::")))
try:
    native.name_kernel_calls()
except RuntimeError as error:
    print("refused:", error)
"""


def test_a_profiling_process_sees_each_kernel_call_under_its_own_name():
    """bench.profile_step names the C kernels' calls (torch's profiler sees a ctypes call only as the Python around
    it); asking once kernels are already looked up, which would leave those unnamed, is refused. A process of its
    own: the lookups are cached for the life of a process."""
    run = subprocess.run([sys.executable, "-c", NAMED_CALL], capture_output=True, text=True, timeout=300,
                         cwd=KERNEL_DIR.parents[2])
    if run.returncode == 3:
        pytest.skip("no C compiler here: the kernels did not build")
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0] == "['tessera::linear_panels_available']"
    assert lines[1].startswith("refused: name_kernel_calls() after kernels were looked up")


def test_the_profile_groups_each_kernel_where_its_time_belongs():
    from bench.profile_step import group_of

    assert group_of("tessera::decode_forward").startswith("decode kernel")
    assert group_of("tessera::decode_forward_panels").startswith("decode kernel")
    for name in ("tessera::linear_panels", "tessera::linear_panels_tiles", "tessera::linear_int8",
                 "tessera::int8_gemm", "tessera::gemv_bf16", "mkldnn::_linear_pointwise"):
        assert group_of(name) == "matmul", name
    assert group_of("tessera::paged_attention") == group_of("tessera::chunk_attention") == "attention"
    assert group_of("tessera::greedy_tiles") == "sampling"
    for name in ("tessera::silu_mul", "tessera::add_rms_norm", "tessera::rope"):
        assert group_of(name).startswith("elementwise"), name
