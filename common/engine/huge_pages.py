"""Host memory in transparent huge pages, for the weights a decode step streams from memory.

A decode step of a few rows reads every weight once, at the memory's streaming rate; in 4 KB pages that read
takes a TLB miss every 4 KB, in 2 MB pages one every 2 MB. A ``HugePageArena`` is one private anonymous mapping,
advised ``MADV_HUGEPAGE`` before any of its pages is touched (so that a first write faults a whole 2 MB page in),
starting on a 2 MB boundary, and carved into tensors 4 KB apart. Where the kernel has no transparent huge pages, or
its policy says ``never``, the advice does nothing and the mapping is ordinary memory; with the policy ``madvise``
(a common default) only advised memory gets them, which torch's allocator does not ask for by default. Its switch
(``THP_MEM_ALLOC_ENABLE``) would advise every allocation of 2 MB or more, a step's temporaries too, whose faults
(and, under the ``madvise`` defrag policy, compaction) would then land inside serving steps; the weights are
written once, at load.

The mapping lives as long as any tensor carved from it: each holds the arena's bytes, whose storage holds the
``mmap`` object. Never close that object while they live (``mmap.close`` would succeed and leave them dangling).
"""
from __future__ import annotations

import ctypes
import math
import mmap
from pathlib import Path

import torch

HUGE_PAGE_BYTES = 2 << 20
ALIGN_BYTES = 4096  # between two tensors of an arena: no two share a cache line, nor a 4 KB page
_THP_POLICY = Path("/sys/kernel/mm/transparent_hugepage/enabled")
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux's value, where the mmap module has no name


def thp_policy() -> str:
    """The kernel's transparent huge page policy (``always``, ``madvise`` or ``never``), or ``unavailable``."""
    try:
        text = _THP_POLICY.read_text()
    except OSError:
        return "unavailable"
    chosen = [word.strip("[]") for word in text.split() if word.startswith("[")]
    return chosen[0] if chosen else "unavailable"


def _aligned(size: int) -> int:
    return -(-size // ALIGN_BYTES) * ALIGN_BYTES


class HugePageArena:
    """``nbytes`` of host memory advised into huge pages (``huge=False``: out of them, whatever the kernel's policy:
    engine.cpu.huge_pages off, or a benchmark's baseline), handed out as tensors (``take``) in order."""

    def __init__(self, nbytes: int, huge: bool = True) -> None:
        self.nbytes = nbytes
        length = _aligned(max(nbytes, 1)) + HUGE_PAGE_BYTES + ALIGN_BYTES  # the last page: a guard (below)
        self._map = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        try:
            self._map.madvise(mmap.MADV_HUGEPAGE if huge else mmap.MADV_NOHUGEPAGE)
        except (AttributeError, OSError):  # a kernel built without transparent huge pages, or another platform
            pass
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        # The kernel merges neighbouring anonymous mappings of the same flags into one, whose smaps line would then
        # count another arena's huge pages as this one's (``huge_bytes``): a last page no one may touch keeps the
        # arena a mapping of its own. Nothing is carved from it; where mprotect fails only that count suffers.
        _protect_none(self._bytes.data_ptr() + length - ALIGN_BYTES, ALIGN_BYTES)
        self._start = (-self._bytes.data_ptr()) % HUGE_PAGE_BYTES
        self._next = self._start

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised contiguous tensor of ``shape`` and ``dtype`` from the arena's next free bytes."""
        size = math.prod(shape) * dtype.itemsize
        end = self._next + size
        if end > self._start + self.nbytes:
            raise ValueError(f"the arena holds {self.nbytes} bytes; {end - self._start} asked for")
        tensor = self._bytes[self._next:end].view(dtype).view(shape)
        self._next += _aligned(size)
        return tensor

    def take_zeroed(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A tensor of zeros, as ``take``, its pages faulted in now. An arena's bytes are handed out once, and
        memory fresh from the kernel reads as zeros, so the kernel faults them in without a write
        (``MADV_POPULATE_WRITE``, Linux 5.14: 256 MiB in 4 KB pages 0.13-0.15 CPU-s against 0.20-0.25 for
        ``zero_``'s faults, on a 2-core AMD EPYC VM); where it cannot, ``zero_`` writes them."""
        tensor = self.take(shape, dtype)
        try:
            self._map.madvise(MADV_POPULATE_WRITE, tensor.data_ptr() - self._bytes.data_ptr(),
                              _aligned(tensor.nbytes))
        except (OSError, ValueError):  # an older kernel (EINVAL), or memory it could not give (ENOMEM)
            tensor.zero_()
        return tensor

    @staticmethod
    def span(sizes: list[int]) -> int:
        """The arena bytes that tensors of ``sizes`` bytes take, in order."""
        return sum(_aligned(size) for size in sizes)

    def address(self) -> int:
        """Where the first tensor ``take`` hands out starts (a 2 MB boundary)."""
        return self._bytes.data_ptr() + self._start

    def huge_bytes(self) -> int:
        """How many of its ``nbytes`` the kernel holds in huge pages now (``/proc/self/smaps``; 0 where unknown)."""
        return min(self.nbytes, mapping_fields(self.address()).get("AnonHugePages", 0))


def _protect_none(address: int, length: int) -> None:
    """``mprotect(address, length, PROT_NONE)`` where the C library has it; nothing where it fails."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mprotect(ctypes.c_void_p(address), ctypes.c_size_t(length), 0)
    except (OSError, AttributeError):
        pass


def mapping_lines(address: int, smaps: Path = Path("/proc/self/smaps")) -> list[str]:
    """The field lines of the ``smaps`` entry of the mapping that holds ``address`` (``VmFlags`` among them: ``hg``
    advised into huge pages, ``nh`` out of them); empty where there is no such file or mapping. Read up to that
    entry and no further: the kernel writes each entry as it is read, walking that mapping's page tables to count
    its pages, and the entries past the arenas (torch's libraries) need not be walked. A read still walks the
    heap's tables before them (tens of milliseconds in a worker, more in a long-lived process): callers that only
    log the count ask for it where the log line is written."""
    found: list[str] | None = None
    try:  # mapped files' names are printed as their bytes, which need not be UTF-8
        with open(smaps, errors="replace") as entries:
            for line in entries:
                head = line.split(maxsplit=1)[0] if line.strip() else ""
                if "-" in head and not head.endswith(":"):  # an entry's first line: its address range
                    if found is not None:
                        return found
                    found = [] if _holds(head, address) else None
                elif found is not None and head.endswith(":"):
                    found.append(line.rstrip("\n"))
    except OSError:
        return []
    return found or []


def _holds(address_range: str, address: int) -> bool:
    """Whether smaps' ``LOW-HIGH`` (hexadecimal) holds ``address``."""
    low, _, high = address_range.partition("-")
    try:
        return int(low, 16) <= address < int(high, 16)
    except ValueError:
        return False


def mapping_fields(address: int, smaps: Path = Path("/proc/self/smaps")) -> dict[str, int]:
    """The ``/proc/self/smaps`` fields (in bytes where they are sizes, else as the number given) of the mapping
    that holds ``address``; empty where there is no such file or mapping."""
    fields: dict[str, int] = {}
    for line in mapping_lines(address, smaps):
        parts = line.split()
        if len(parts) >= 2 and parts[1].isdigit():
            fields[parts[0][:-1]] = int(parts[1]) * (1024 if parts[-1] == "kB" else 1)
    return fields
