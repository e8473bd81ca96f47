"""``tessera --version`` and ``tessera status`` against a running proxy with a prefill and a decode worker."""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys

from common.protocol.wire import PROTOCOL_VERSION
from tests.e2e.proxy_harness import *  # noqa: F401,F403 -- fixtures, helpers and wire types

ADMIN_KEY = "status-admin-key"


def tessera(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "common.cli.main", *args], capture_output=True, text=True,
                          timeout=STARTUP_S)


def test_version_names_the_release_and_the_wire_protocol():
    result = tessera("--version")
    assert result.returncode == 0 and result.stdout.startswith("tessera ")
    assert f"(wire protocol {PROTOCOL_VERSION})" in result.stdout


def test_status_lists_each_worker_with_its_role_model_and_pages(make_proxy, make_worker, tmp_path):
    proxy = make_proxy(security={"admin_api_key_sha256": hashlib.sha256(ADMIN_KEY.encode()).hexdigest()})
    make_worker(proxy, "p0", "prefill")
    make_worker(proxy, "d0", "decode")
    ready(proxy)
    key_file = tmp_path / "admin.key"
    key_file.write_text(ADMIN_KEY + "\n")

    shown = tessera("status", "--proxy", proxy.url, "--admin-key-file", str(key_file))
    assert shown.returncode == 0, shown.stdout + shown.stderr
    lines = shown.stdout.splitlines()
    assert "ready" in lines[0] and f"wire protocol {PROTOCOL_VERSION}" in lines[0]
    rows = {line.split()[0]: line.split() for line in lines if line.startswith(("p0", "d0"))}
    assert rows["p0"][1] == "prefill" and rows["d0"][1] == "decode"
    assert all(row[3] == "1" and row[4] == "serving" for row in rows.values())  # TP, state

    listed = json.loads(tessera("status", "--proxy", proxy.url, "--admin-key-file", str(key_file), "--json").stdout)
    workers = {w["worker_id"]: w for w in listed["workers"]["data"]}
    assert set(workers) == {"p0", "d0"} and listed["workers"]["ready"] is True
    assert all(0 < w["kv_pages_free"] <= w["kv_pages_total"] for w in workers.values())
    assert all(w["tensor_parallel_size"] == 1 for w in workers.values())

    anonymous = tessera("status", "--proxy", proxy.url)
    assert anonymous.returncode == 0 and "pass --admin-key-file" in anonymous.stdout
    wrong = tmp_path / "wrong.key"
    wrong.write_text("nope")
    refused = tessera("status", "--proxy", proxy.url, "--admin-key-file", str(wrong))
    assert refused.returncode == 1 and "(401)" in refused.stdout
