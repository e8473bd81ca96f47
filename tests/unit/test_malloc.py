"""The C allocator a worker runs on (common/engine/malloc.py, engine.cpu.malloc): jemalloc preloaded by starting the
process again (same pid), glibc's where asked or where the library is missing, and jemalloc's memory bounded where
glibc's told to keep freed blocks was not. Each probe runs in a fresh interpreter: the allocator is the process's."""
import os
import subprocess
import sys

import pytest

from common.engine.malloc import JEMALLOC_CONF, REEXEC_ENV, find_jemalloc, preload_environment, use_configured_malloc

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HAVE_JEMALLOC = find_jemalloc() is not None
needs_jemalloc = pytest.mark.skipif(not HAVE_JEMALLOC, reason="libjemalloc.so.2 is not installed on this host "
                                    "(Debian/Ubuntu: apt install libjemalloc2)")

PROBE = """
import os, sys
from common.engine.malloc import use_configured_malloc
running = use_configured_malloc(sys.argv[1])
print(running, os.environ.get("LD_PRELOAD", "-"), os.environ.get("MALLOC_CONF", "-"), os.environ.get("%s", "-"),
      os.getpid())
""" % REEXEC_ENV

# A large block freed with small blocks allocated after it, round after round: the pattern under which glibc, told
# to keep freed memory (mallopt), grew by a block a round. The resident size after each round, in MiB.
GROWTH = """
import torch
from common.engine.malloc import use_configured_malloc
assert use_configured_malloc("jemalloc") == "jemalloc"
def rss_mib():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 >> 20
kept, sizes = [], [rss_mib()]
for _ in range(10):
    big = torch.empty(96 << 20, dtype=torch.uint8)
    big.fill_(1)
    kept.append(torch.empty(1000, dtype=torch.uint8))
    middle = torch.empty(40 << 20, dtype=torch.uint8)
    middle.fill_(2)
    del big
    kept.append(torch.empty(3000, dtype=torch.uint8))
    del middle
    sizes.append(rss_mib())
print(*sizes)
"""


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "MALLOC_CONF", REEXEC_ENV)}
    return {**env, "PYTHONPATH": ROOT, **extra}


def probe(choice: str, env: dict[str, str]) -> list[str]:
    script = subprocess.run([sys.executable, "-c", PROBE, choice], capture_output=True, text=True, check=True,
                            env=env, cwd=ROOT, timeout=120)
    return script.stdout.split()


def test_the_preload_goes_first_once_and_an_operators_conf_wins():
    env = preload_environment({"LD_PRELOAD": "/a.so /lib/je.so:/b.so", "MALLOC_CONF": "narenas:1"}, "/lib/je.so")
    assert env["LD_PRELOAD"] == "/lib/je.so:/a.so:/b.so"
    assert env["MALLOC_CONF"] == "narenas:1"
    assert preload_environment({}, "/lib/je.so") == {"LD_PRELOAD": "/lib/je.so", "MALLOC_CONF": JEMALLOC_CONF}


def test_an_unknown_choice_names_the_setting():
    with pytest.raises(ValueError, match=r"engine\.cpu\.malloc='tcmalloc'"):
        use_configured_malloc("tcmalloc")


@needs_jemalloc
def test_jemalloc_is_preloaded_by_starting_the_process_again():
    running, preload, conf, marker, _ = probe("jemalloc", clean_env())
    assert running == "jemalloc"
    assert preload.split(":")[0] == find_jemalloc()  # and what the worker starts inherits it
    assert conf == JEMALLOC_CONF
    assert marker == "-"  # the one-time marker is gone once it is loaded


@needs_jemalloc
def test_the_process_keeps_its_pid_across_the_restart():
    """A supervisor (systemd, ``tessera up``, the tests) follows the pid it started."""
    proc = subprocess.Popen([sys.executable, "-c", PROBE, "jemalloc"], env=clean_env(), cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0
    assert out.split()[0] == "jemalloc"
    assert int(out.split()[-1]) == proc.pid


def test_system_starts_nothing_again():
    running, preload, conf, _, _ = probe("system", clean_env())
    assert (running, preload, conf) == ("system", "-", "-")


def test_a_refused_preload_is_not_retried():
    """Once started again (the marker set) without the library mapped, the process goes on with glibc's malloc."""
    running, preload, _, _, _ = probe("jemalloc", clean_env(**{REEXEC_ENV: "1"}))
    assert (running, preload) == ("system", "-")


@needs_jemalloc
def test_jemalloc_keeps_freed_pages_without_growing():
    script = subprocess.run([sys.executable, "-c", GROWTH], capture_output=True, text=True, check=True,
                            env=clean_env(), cwd=ROOT, timeout=300)
    base, *sizes = [int(size) for size in script.stdout.split()]
    assert sizes[-1] - sizes[0] < 96, f"resident MiB before and by round: {base} {sizes}"  # no block more since
    assert sizes[0] - base >= 96 + 40 - 8, f"resident MiB before and by round: {base} {sizes}"  # freed pages kept


@needs_jemalloc
def test_a_purge_gives_freed_pages_back():
    """After a model's load (model_runner): its temporaries' kept pages go back to the kernel."""
    script = """
import torch
from common.engine.malloc import release_freed_memory, use_configured_malloc
assert use_configured_malloc("jemalloc") == "jemalloc"
def rss_mib():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 >> 20
block = torch.ones(200 << 20, dtype=torch.uint8)
del block
kept = rss_mib()
print(release_freed_memory(), kept - rss_mib())
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                          env=clean_env(), cwd=ROOT, timeout=120)
    purged, freed_mib = done.stdout.split()
    assert purged == "True" and int(freed_mib) >= 190, done.stdout


def test_no_purge_without_jemalloc():
    done = subprocess.run([sys.executable, "-c", "from common.engine.malloc import release_freed_memory as r; "
                           "print(r())"], capture_output=True, text=True, check=True, env=clean_env(), cwd=ROOT,
                          timeout=120)
    assert done.stdout.split() == ["False"]


@needs_jemalloc
def test_jemalloc_preloaded_by_hand_gets_the_settings():
    """An operator's ``LD_PRELOAD`` without ``MALLOC_CONF``: started again once with Tessera's; their own wins."""
    running, _, conf, marker, _ = probe("jemalloc", clean_env(LD_PRELOAD=find_jemalloc()))
    assert (running, conf, marker) == ("jemalloc", JEMALLOC_CONF, "-")
    running, _, conf, _, _ = probe("jemalloc", clean_env(LD_PRELOAD=find_jemalloc(), MALLOC_CONF="narenas:2"))
    assert (running, conf) == ("jemalloc", "narenas:2")


def test_an_operators_own_preloaded_allocator_is_kept():
    """No second malloc beside one the operator preloaded (a name the loader may not even find here)."""
    running, preload, conf, _, _ = probe("jemalloc", clean_env(LD_PRELOAD="libtcmalloc_minimal.so.4"))
    assert (running, preload, conf) == ("system", "libtcmalloc_minimal.so.4", "-")
