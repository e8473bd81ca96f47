"""Fixtures shared by every test directory."""
from __future__ import annotations

from pathlib import Path

import pytest

from common.storage.model_store import resolve_model


@pytest.fixture(scope="session")
def embedded_model_dir() -> Path:
    """The embedded SmolLM2-135M-Instruct in float32, prepared in the default cache on first use."""
    return resolve_model("embedded", "float32")


@pytest.fixture(scope="session")
def embedded_model_dir_bf16() -> Path:
    """The embedded SmolLM2-135M-Instruct in bfloat16, prepared in the default cache on first use."""
    return resolve_model("embedded", "bfloat16")


@pytest.fixture(scope="session")
def tiny_chat_model_dir(tmp_path_factory, embedded_model_dir) -> Path:
    """A tiny random Llama with the embedded model's tokenizer: the whole engine in milliseconds."""
    from tests.tiny_models import build_tiny_model

    return build_tiny_model("llama", tmp_path_factory.mktemp("tiny-chat"), tokenizer_from=embedded_model_dir)
