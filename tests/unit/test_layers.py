"""Layers point one way, and no module imports itself through others.

The layer contracts are import-linter's, declared in ``pyproject.toml``
(``[tool.importlinter]``): experiments over bench, bench over the roles, the roles over kv_transfer,
kv_transfer over common; inside common, cli > runtime > engine > storage >
config > text > protocol; inside the proxy, its process modules > edge >
cluster > control > tenancy > core (every module in one of them); the proxy
never reaches the engine, torch or transformers. The proxy's rooms are also
checked here on their own, naming each import against their order. The cycle
check runs over the same import graph (grimp's).
"""
from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("common", "kv_transfer", "prefill_worker", "decode_worker", "proxy", "bench", "experiments")


def test_layer_contracts_hold():
    lint = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run([str(lint), "--config", str(ROOT / "pyproject.toml"), "--no-cache"], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]


def proxy_layers() -> list[set[str]]:
    """The proxy's layers, top first, as import-linter's ``proxy-rooms`` contract declares them: each the set of
    the modules or rooms (``proxy.<name>``) in it."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    contract = next(c for c in config["tool"]["importlinter"]["contracts"] if c.get("id") == "proxy-rooms")
    return [set(re.split(r"\s*[|:]\s*", layer.strip())) for layer in contract["layers"]]


def against_the_order(imports: dict[str, set[str]], layers: list[set[str]]) -> list[str]:
    """Each import of one of the proxy's layers (``layers``, top first) by a module of a layer below it, as
    ``importer -> imported``."""
    def depth(module: str) -> int | None:
        parts = module.split(".")
        if parts[0] != "proxy" or len(parts) < 2:
            return None
        return next((i for i, layer in enumerate(layers) if parts[1] in layer), None)

    return sorted(f"{importer} -> {imported}" for importer, targets in imports.items() for imported in targets
                  if (low := depth(importer)) is not None and (high := depth(imported)) is not None and high < low)


def test_the_proxy_rooms_import_one_way():
    layers = proxy_layers()
    assert [sorted(layer) for layer in layers[1:]] == [["edge"], ["cluster"], ["control"], ["tenancy"], ["core"]]
    graph = grimp.build_graph("proxy", cache_dir=None)  # the files as they are now, not as a cache saw them
    imports = {m: graph.find_modules_directly_imported_by(m) for m in graph.modules}
    wrong = against_the_order(imports, layers)
    assert not wrong, ("imports against the proxy's room order (process > edge > cluster > control > tenancy > "
                       "core; pyproject.toml's proxy-rooms contract):\n" + "\n".join(wrong))


def test_an_import_against_the_room_order_is_found():
    layers = [{"main", "app"}, {"edge"}, {"core"}]
    imports = {"proxy.core.requests": {"proxy.edge.streaming", "proxy.core.errors", "common.protocol.wire"},
               "proxy.edge.streaming": {"proxy.core.requests"}, "proxy.edge.openai_api": {"proxy.app"},
               "proxy.main": {"proxy.app", "proxy.edge.listener"}}
    assert against_the_order(imports, layers) == ["proxy.core.requests -> proxy.edge.streaming",
                                                  "proxy.edge.openai_api -> proxy.app"]


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components with more than one module, or a module importing itself."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def visit(root: str) -> None:
        nonlocal counter
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            advanced = False
            for succ in edges:
                if succ not in index:
                    index[succ] = low[succ] = counter
                    counter += 1
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(graph[succ]))))
                    advanced = True
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph[node]:
                    found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def test_no_import_cycles():
    graph = grimp.build_graph(*PACKAGES)
    edges = {m: graph.find_modules_directly_imported_by(m) & graph.modules for m in graph.modules}
    cycles = strongly_connected(edges)
    assert not cycles, "modules in an import cycle:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_cycle_finder_finds_a_cycle():
    assert strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert strongly_connected({"a": {"b"}, "b": set()}) == []
