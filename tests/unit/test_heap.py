"""A CPU worker's heap policy (common/engine/heap.py, engine.cpu.keep_freed_memory): a large temporary is served
from the heap, not from pages mapped for it. Each case runs in a fresh interpreter, since the policy is the whole
process's. (Whether the next one reuses the memory depends on what was allocated after it: the policy's hazard,
docs/benchmarks.md.)"""
import subprocess
import sys

import pytest

PROBE = """
import ctypes, sys, torch
from common.engine.heap import keep_freed_memory

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
if sys.argv[1] == "keep":
    assert keep_freed_memory() and keep_freed_memory()  # once set, it stays set
size = 96 << 20  # past glibc's largest mmap threshold (32 MB)
first = torch.empty(size, dtype=torch.uint8)
print(libc.mallinfo2().hblkhd >= size)  # mapped for itself
"""


def probe(mode: str) -> str:
    return subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True,
                          timeout=120).stdout.split()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt and mallinfo2: Linux")
def test_a_large_temporary_comes_from_the_heap():
    assert probe("keep") == ["False"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt and mallinfo2: Linux")
def test_without_the_policy_glibc_maps_a_large_temporary():
    """The case the policy exists for: the block is mapped for itself (and unmapped when freed)."""
    assert probe("default") == ["True"]
