"""docs/configuration.md is generated from the config definitions and every field has a doc."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from common.cli.main import main
from common.config.docs import REGENERATE, missing_docs, render, sections

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
    found = sections()
    names = [name for name, *_ in found]
    assert names == ["proxy", "proxy.http", "proxy.requests", "proxy.sessions", "proxy.kv_pipeline", "proxy.tenancy",
                     "proxy.tenancy.tenants[]",
                     "proxy.shared_state", "proxy.slo", "proxy.planner", "proxy.observability", "proxy.security",
                     "worker",
                     "worker.engine", "worker.engine.kv_tiers", "worker.engine.ranks", "worker.engine.cpu",
                     "worker.engine.cuda_graphs", "worker.engine.steps", "worker.engine.spec", "worker.engine.int8",
                     "worker.transfer", "worker.observability", "worker.security", "worker.testing"]
    text = render()
    for name, cls, *_ in found:
        part = text.split(f"## `{name}`\n")[1].split("\n## ")[0]
        for f in dataclasses.fields(cls):
            assert f"| `{f.name}` |" in part, f"{name}.{f.name} is missing from the reference"


@pytest.mark.parametrize("role", ["proxy", "worker"])
def test_no_section_of_a_roles_config_has_more_than_25_fields(role, capsys):
    """What `tessera config schema` prints: the file's top level and every object in it."""
    assert main(["config", "schema", role]) == 0
    schema = json.loads(capsys.readouterr().out)
    objects = {"(top level)": schema, **schema.get("$defs", {})}
    sizes = {name: len(obj.get("properties", {})) for name, obj in objects.items()}
    assert len(sizes) > 3 and max(sizes.values()) <= 25, sizes


def test_the_shipped_configs_set_nothing_of_the_testing_section():
    for path in (DOCS.parents[1] / "configs").rglob("*.yaml"):
        assert "testing" not in (yaml.safe_load(path.read_text()) or {}), path


def test_rows_carry_type_default_allowed_values_and_doc():
    text = render()
    assert "| `role` | `str` | `\"both\"` | one of 'prefill', 'decode', 'both' | what this worker does |" in text
    assert "| `port` | `int` | `8000` | > 0 |" in text
    # The engine section shows the defaults a worker's engine starts from, not the bare dataclass's.
    assert "| `model` | `str` | `\"embedded\"` |" in text.split("## `worker.engine`")[1]
    assert "| `name` | `str` | required |" in text.split("## `proxy.tenancy.tenants[]`")[1]
    assert "| `tls_cert_file` | `str` | `\"\"` | path to an existing file, or empty |" in text


def test_the_docs_command_prints_the_reference(capsys):
    assert main(["config", "docs"]) == 0
    assert capsys.readouterr().out == render()
