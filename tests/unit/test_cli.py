"""The tessera command line: parsing, errors, and the chat loop against a fake engine."""
from __future__ import annotations

import io
import os
import sys
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from common.cli import generate_command
from common.cli.main import build_parser, main
from common.cli.options import DEFAULT_DTYPE
from common.config.base import EngineConfig
from common.storage.model_store import prepare_embedded_model
from common.protocol.sampling_params import SamplingParams


@pytest.mark.parametrize(
    "argv, expected",
    [
        ([], "model"),
        (["model"], "prepare"),
        (["model", "prepare"], "--cache-dir"),
        (["model", "path"], "--dtype"),
        (["generate"], "--no-chat"),
        (["curve-keys", "generate"], "--out"),
        (["api-keys"], "generate"),
        (["api-keys", "hash"], "KEY"),
    ],
)
def test_every_command_has_help(capsys, argv, expected):
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--help"])
    assert exit_.value.code == 0
    assert expected in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, new",
    [
        (["proxy", "--workers", "2"], "tessera proxy: --workers is now --processes"),
        (["sim-worker", "--proxy", "tcp://127.0.0.1:5555"], "tessera sim-worker: --proxy is now --proxy-address"),
        (["model", "register", "m", "--name", "m", "--version", "v1"], "--version is now --model-version"),
    ],
)
def test_a_renamed_option_fails_naming_the_new_one(capsys, argv, new):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert new in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize(
    "argv, new",
    [
        (["keys", "generate", "--out", "keys", "--name", "proxy"], "`tessera curve-keys`"),
        (["tenants", "hash-key", "--generate"], "`tenants hash-key --generate` is `api-keys generate`"),
        (["tenants", "--help"], "`tenants hash-key` is `api-keys hash`"),
    ],
)
def test_a_renamed_command_fails_naming_the_new_one(capsys, argv, new):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert new in err and len(err.strip().splitlines()) == 1, err


def test_every_command_that_serves_or_prepares_a_model_defaults_to_one_dtype():
    """The workers' engine.dtype too: ``tessera model prepare`` makes the model that ``tessera up``, ``generate``
    and a worker started from a config without engine.dtype load."""
    parser = build_parser()
    commands = [["up"], ["generate"], ["model", "prepare"], ["model", "path"], ["model", "random", "--shape", "tiny"]]
    dtypes = {parser.parse_args(argv).dtype for argv in commands}
    assert dtypes == {DEFAULT_DTYPE} == {EngineConfig(model="embedded").dtype}


def test_a_command_is_required(capsys):
    with pytest.raises(SystemExit) as exit_:
        main([])
    assert exit_.value.code == 2


def test_model_path_prints_only_the_directory(tmp_path, capsys):
    prepared = prepare_embedded_model(
        "bfloat16",
        tmp_path,
        fetch_gguf=lambda dest, log: dest.write_bytes(b"gguf"),
        convert=_fake_convert,
        log=lambda message: None,
    )
    assert main(["model", "path", "--dtype", "bfloat16", "--cache-dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out == f"{prepared}\n"


def _fake_convert(gguf: Path, out_dir: Path, dtype: str, log) -> None:
    (out_dir / "config.json").write_text(json.dumps({"dtype": dtype}))
    (out_dir / "model.safetensors").write_bytes(b"")


def test_bad_sampling_flag_fails_before_loading_a_model(capsys):
    assert main(["generate", "--prompt", "hi", "--top-p", "2", "--model", "/nonexistent"]) == 2
    assert "'top_p'" in capsys.readouterr().err


def test_unknown_model_is_reported(capsys):
    assert main(["generate", "--prompt", "hi", "--model", "gpt-5"]) == 2
    assert "unknown model 'gpt-5'" in capsys.readouterr().err


def test_empty_stdin_is_an_error(monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("\n  \n"))
    assert main(["generate"]) == 2
    assert "no prompts" in capsys.readouterr().err


class FakeEngine:
    """Answers each request with the next canned reply in one step."""

    model_dir = Path("fake-model")

    def __init__(self, replies: list[str]) -> None:
        self.replies = iter(replies)
        self.templated: list[list[dict]] = []
        self.prompts: list = []
        self.running: str | None = None
        self.tokenizer = SimpleNamespace(apply_chat_template=self._apply_chat_template)

    def _apply_chat_template(self, messages: list[dict]) -> list[int]:
        self.templated.append([dict(m) for m in messages])
        return [len(messages)]

    def add_request(self, request_id: str, prompt, params: SamplingParams) -> None:
        if prompt == "too long":
            raise ValueError("the prompt has too many tokens")
        self.prompts.append(prompt)
        self.running = request_id

    def has_unfinished(self) -> bool:
        return self.running is not None

    def step(self) -> list:
        reply = next(self.replies)
        completion = SimpleNamespace(text=reply, text_delta=reply, finish_reason="stop")
        request_id, self.running = self.running, None
        return [SimpleNamespace(request_id=request_id, outputs=[completion])]


def type_lines(monkeypatch, lines: list[str]) -> None:
    pending = iter(lines)

    def fake_input(prompt: str = "") -> str:
        try:
            return next(pending)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr("builtins.input", fake_input)


def test_chat_keeps_the_conversation(monkeypatch, capsys):
    engine = FakeEngine(["Hello!", "Paris."])
    type_lines(monkeypatch, ["hi", "", "capital of France?", "/exit", "never read"])
    generate_command._chat(engine, SamplingParams(), use_template=True)
    assert engine.templated[1] == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "capital of France?"},
    ]
    out = capsys.readouterr().out
    assert "Hello!" in out and "Paris." in out


def test_chat_reset_forgets_and_eof_leaves(monkeypatch):
    engine = FakeEngine(["one", "two"])
    type_lines(monkeypatch, ["first", "/reset", "second"])
    generate_command._chat(engine, SamplingParams(), use_template=True)
    assert engine.templated[1] == [{"role": "user", "content": "second"}]


def test_chat_without_template_sends_each_line_alone(monkeypatch):
    engine = FakeEngine(["a", "b"])
    type_lines(monkeypatch, ["once upon", "a time"])
    generate_command._chat(engine, SamplingParams(), use_template=False)
    assert engine.prompts == ["once upon", "a time"]
    assert engine.templated == []


def test_chat_survives_a_refused_request(monkeypatch, capsys):
    engine = FakeEngine(["fine"])
    type_lines(monkeypatch, ["too long", "short"])
    generate_command._chat(engine, SamplingParams(), use_template=False)
    assert engine.prompts == ["short"]
    assert "too many tokens" in capsys.readouterr().err


def test_the_command_sets_libgomp_s_spin_unless_the_environment_does(monkeypatch, capsys):
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    assert main(["config", "docs"]) == 0
    assert os.environ["GOMP_SPINCOUNT"] == "10000"
    monkeypatch.setenv("GOMP_SPINCOUNT", "300000")
    assert main(["config", "docs"]) == 0
    assert os.environ["GOMP_SPINCOUNT"] == "300000"


def test_generate_sizes_the_kv_pool_to_its_prompts_or_to_one_whole_conversation(tiny_chat_model_dir, monkeypatch):
    # what it asks the engine for; the engine's sizing from it: tests/unit/test_engine_memory.py
    monkeypatch.setattr("common.engine.llm_engine.LLMEngine", lambda config, kv_tokens: kv_tokens)
    args = SimpleNamespace(dtype="float32", threads=None, deterministic=False)
    assert generate_command._load_engine(args, tiny_chat_model_dir, [40, 50]) == [40, 50]
    assert generate_command._load_engine(args, tiny_chat_model_dir, None) == [sys.maxsize]  # the chat: the context
