"""docs/configuration.md is generated from the config definitions and every field has a doc."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from common.cli.main import main
from common.config.base import EngineConfig
from common.config.docs import REGENERATE, missing_docs, render, sections
from common.config.roles import ProxyConfig, TenantConfig, WorkerConfig

DOCS = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_every_config_field_has_a_doc():
    missing = missing_docs()
    assert not missing, (
        f"config fields without a doc: {', '.join(missing)}. Declare each with "
        "common.config.base.option(default, \"one-line doc\", choices=/ge=/gt=/path= as it allows), then run "
        f"`{REGENERATE}`."
    )


def test_committed_reference_matches_the_definitions():
    assert DOCS.read_text() == render(), (
        f"docs/configuration.md is stale: run `{REGENERATE}` and commit the result"
    )


def test_every_section_and_field_is_in_the_reference():
    names = [name for name, *_ in sections()]
    assert names == ["proxy", "proxy.tenants[]", "worker", "worker.engine"]
    text = render()
    for cls in (ProxyConfig, TenantConfig, WorkerConfig, EngineConfig):
        for f in dataclasses.fields(cls):
            assert f"| `{f.name}` |" in text, f"{cls.__name__}.{f.name} is missing from the reference"


def test_rows_carry_type_default_allowed_values_and_doc():
    text = render()
    assert "| `role` | `str` | `\"both\"` | one of 'prefill', 'decode', 'both' | what this worker does |" in text
    assert "| `port` | `int` | `8000` | > 0 |" in text
    # The engine section shows the defaults a worker's engine starts from, not the bare dataclass's.
    assert "| `model` | `str` | `\"embedded\"` |" in text.split("## `worker.engine`")[1]
    assert "| `name` | `str` | required |" in text.split("## `proxy.tenants[]`")[1]
    assert "| `tls_cert_file` | `str` | `\"\"` | path to an existing file, or empty |" in text


def test_the_docs_command_prints_the_reference(capsys):
    assert main(["config", "docs"]) == 0
    assert capsys.readouterr().out == render()
