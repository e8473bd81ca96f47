"""The tests' fork server (tests/fork_server.py): a forked worker exits, logs and takes signals as a fresh
``python -m common.cli.main`` would, and a worker whose libraries would load under other variables gets a server
of its own."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests import fork_server


def fresh(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "common.cli.main", *args], env=env, capture_output=True, text=True,
                          timeout=120)


def forked(args: list[str], env: dict[str, str], log_path, new_session: bool = False) -> fork_server.ForkedProcess:
    with open(log_path, "w") as log:
        proc = fork_server.spawn(args, env, log, new_session)
    assert proc is not None, "the worker was not forked"
    return proc


def first_lines(text: str) -> list[str]:
    """``text``'s first line and its first that is not a log record, each less a log record's time and process id
    (a warning such as the missing jemalloc's can come first, logged by the two processes at different times under
    different ids, before the command's own output)."""
    lines = [re.sub(r"\[\d+\]", "[pid]", re.sub(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ ", "", line))
             for line in text.split("\n")]
    record = re.compile(r"^(DEBUG|INFO|WARNING|ERROR|CRITICAL) \S+ \[pid\] ")
    return [lines[0], next((line for line in lines if not record.match(line)), "")]


@pytest.fixture
def env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1"}


@pytest.mark.parametrize("args", [["prefill", "--help"], ["decode", "--set", "no_such_field=1"],
                                  ["both", "--set", "engine.model=/no/such/model"], ["proxy", "--set", "port=-1"]])
def test_a_forked_command_exits_and_writes_as_a_fresh_interpreter(args, env, tmp_path):
    proc = forked(args, env, tmp_path / "log")
    code = proc.wait(timeout=120)
    expected = fresh(args, env)
    assert code == expected.returncode
    text = (tmp_path / "log").read_text()
    assert first_lines(text) == first_lines(expected.stdout + expected.stderr), text
    assert proc.poll() == code and proc.returncode == code


def test_a_forked_worker_takes_signals_in_its_own_session(env, tmp_path, tiny_chat_model_dir, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # a worker whose proxy never answers: it waits to register until it is stopped
    args = ["both", "--set", f"engine.model={tiny_chat_model_dir}", "--set", "proxy_address=tcp://127.0.0.1:9",
            "--set", "observability.metrics_port=0"]
    proc = forked(args, env, tmp_path / "log", new_session=True)
    assert os.getsid(proc.pid) == proc.pid
    assert os.readlink(f"/proc/{proc.pid}/cwd") == str(tmp_path), "the working directory of the test that started it"
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.5)
    assert proc.poll() is None
    counted = fork_server.reaped_cpu_s()
    proc.kill()
    with ThreadPoolExecutor(4) as pool:  # several threads waiting on one handle all see its status
        codes = list(pool.map(lambda _: proc.wait(timeout=60), range(4)))
    assert codes == [-signal.SIGKILL] * 4 and proc.poll() == -signal.SIGKILL
    assert fork_server.reaped_cpu_s() > counted, "its CPU time counts as a reaped child's (tests/cpu_report.py)"
    proc.kill()  # exited: as Popen, nothing is signalled


def test_other_load_time_variables_get_a_server_of_their_own(env, tmp_path):
    first = forked(["prefill", "--help"], env, tmp_path / "a")
    other = forked(["prefill", "--help"], {**env, "OMP_WAIT_POLICY": "passive"}, tmp_path / "b")
    assert first.wait(timeout=120) == other.wait(timeout=120) == 0
    assert first.server is not other.server
    assert fork_server.spawn(["status"], env, None, False) is None, "a command without a server starts fresh"


def test_a_forked_worker_adopts_the_model_its_server_loaded(env, tmp_path, tiny_chat_model_dir, monkeypatch):
    """On one thread (a lane's OMP_NUM_THREADS=1) the server loads a float32 worker's model before forking it, and
    the worker serves those weights rather than loading its own (common/engine/models/preloaded.py)."""
    monkeypatch.chdir(tmp_path)
    args = ["both", "--set", f"engine.model={tiny_chat_model_dir}", "--set", "proxy_address=tcp://127.0.0.1:9",
            "--set", "observability.metrics_port=0"]
    log = tmp_path / "log"
    proc = forked(args, {**env, "OMP_NUM_THREADS": "1"}, log)
    try:
        for _ in range(1200):  # its load line, then it waits to register until it is stopped
            if "model loaded in" in log.read_text() or proc.poll() is not None:
                break
            time.sleep(0.1)
        assert "its weights the parent process's" in log.read_text(), log.read_text()
    finally:
        proc.kill()
        proc.wait(timeout=60)
