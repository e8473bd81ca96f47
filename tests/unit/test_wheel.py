"""A non-editable install (what the Dockerfiles do) carries every sub-package and registers every role.

The wheel is built from a copy of the tree (so no build/ or egg-info lands in
the checkout), installed into a directory of its own with ``--no-deps`` (the
dependencies are this environment's), and imported from a process whose
working directory is outside the tree, with that directory first on its path:
every module must come from the wheel, and ``tessera``'s subcommands from the
wheel's entry points. The one-off measurements in experiments/ stay out of it.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODULES = [
    "common.cli.main", "common.cli.local_cluster", "common.config.roles", "common.engine.llm_engine",
    "common.engine.native", "common.protocol.wire", "common.runtime.worker_runtime", "common.storage.model_store",
    "common.text.tokenizer", "kv_transfer.factory", "kv_transfer.zmq_backend",
    "proxy.main", "proxy.app", "proxy.cluster.cluster", "prefill_worker.command", "prefill_worker.worker",
    "decode_worker.command", "decode_worker.worker", "bench.loadgen.command",
]
PROBE = """
import importlib, importlib.metadata, json, sys
site = sys.argv[1]
files = {name: importlib.import_module(name).__file__ for name in json.loads(sys.argv[2])}
dist = importlib.metadata.distribution("tessera")
commands = sorted(ep.name for ep in dist.entry_points if ep.group == "tessera.commands")
print(json.dumps({"files": files, "commands": commands, "dist": str(dist.locate_file(""))}))
"""


def test_the_wheel_carries_every_package_and_registers_every_role(tmp_path):
    source = tmp_path / "src"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".venv", ".git", "build", "*.egg-info", "__pycache__", ".hypothesis", ".pytest_cache", "docs", "deploy"))
    pip = [sys.executable, "-m", "pip", "--quiet", "--disable-pip-version-check"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"), str(source)],
                   check=True, timeout=300)
    wheel = next((tmp_path / "dist").glob("tessera-*.whl"))
    site = tmp_path / "site"
    subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)], check=True, timeout=300)

    env = {**os.environ, "PYTHONPATH": str(site)}
    probe = subprocess.run([sys.executable, "-c", PROBE, str(site), json.dumps(MODULES)], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=300)
    assert probe.returncode == 0, probe.stderr[-3000:]
    found = json.loads(probe.stdout.splitlines()[-1])
    outside = {name: path for name, path in found["files"].items() if not path.startswith(str(site))}
    assert not outside, f"modules not from the wheel: {outside}"
    assert found["dist"].startswith(str(site))
    assert {"proxy", "prefill", "decode", "both"} <= set(found["commands"]), found["commands"]
    kernels = site / "common" / "engine" / "kernels"
    assert list(kernels.glob("*.c")) and list(kernels.glob("*.h")), "the C kernels ship as source, headers too"
    assert (site / "bench" / "loadgen" / "prompt_set.json").is_file()
    assert not (site / "experiments").exists(), "experiments/ is run from a checkout, never installed"
