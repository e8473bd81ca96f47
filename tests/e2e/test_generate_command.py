"""`tessera generate` as a user runs it: a real process on the embedded model."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parents[2]
GREEDY = ["--temperature", "0", "--max-tokens", "30"]


def tessera(*args: str, stdin=subprocess.DEVNULL, input: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "common.cli.main", *args],
        cwd=REPO_ROOT,
        stdin=None if input is not None else stdin,
        input=input,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_one_prompt(embedded_model_dir):
    result = tessera("generate", "--prompt", "What is the capital of France?", *GREEDY)
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


def test_prompts_from_stdin_lines_run_as_a_batch(embedded_model_dir):
    result = tessera(
        "generate", *GREEDY, input="What is the capital of France?\n\nSay hello.\n"
    )
    assert result.returncode == 0, result.stderr
    first, second = result.stdout.rstrip("\n").split("\n\n")
    assert "Paris" in first
    assert second.strip()


def test_interactive_chat_on_a_terminal(embedded_model_dir):
    # A pseudo-terminal on stdin is what makes the command chat instead of reading prompt lines.
    terminal, stdin = os.openpty()
    process = subprocess.Popen(
        [sys.executable, "-m", "common.cli.main", "generate", *GREEDY],
        cwd=REPO_ROOT,
        stdin=stdin,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    os.close(stdin)
    try:
        os.write(terminal, b"What is the capital of France?\nThank you!\n/exit\n")
        out, err = process.communicate(timeout=300)
    finally:
        process.kill()
        os.close(terminal)
    assert process.returncode == 0, err
    assert "Chatting with SmolLM2-135M-Instruct-float32" in err
    assert out.count("> ") >= 3, "one prompt per turn, and one for /exit"
    assert "Paris" in out
