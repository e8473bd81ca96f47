"""Fixtures shared by every test directory."""
from __future__ import annotations

from pathlib import Path

import pytest

from common.model_store import resolve_model


@pytest.fixture(scope="session")
def embedded_model_dir() -> Path:
    """The embedded SmolLM2-135M-Instruct in float32, prepared in the default cache on first use."""
    return resolve_model("embedded", "float32")


@pytest.fixture(scope="session")
def embedded_model_dir_bf16() -> Path:
    """The embedded SmolLM2-135M-Instruct in bfloat16, prepared in the default cache on first use."""
    return resolve_model("embedded", "bfloat16")
