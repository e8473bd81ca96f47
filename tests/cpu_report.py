"""Where the suite's CPU time goes, per test and per module: what a shorter CI run has to cut.

``make test`` is bound by the two cores (its lanes keep both busy), so its length is the CPU-seconds of its tests,
not their wall time. Load this plugin with a directory to write to, and each test process (every xdist lane) records
for each test its wall time, its own CPU time and that of the processes it reaped (the clusters it started and
stopped: a module's cluster, stopped at the module's end, counts for its last test):

    TESSERA_CPU_REPORT=/tmp/cpu make test PYTEST_ARGS="-p tests.cpu_report"
    .venv/bin/python -m tests.cpu_report /tmp/cpu            # modules by CPU-seconds; --tests: tests

The first lines sum each lane's tests (tests/conftest.py ``lane``): the run is as long as its longest lane, or as
its CPU-seconds over the two cores, whichever is more.

Then the processes the fork servers forked (tests/fork_server.py), by command: how many, and their CPU-seconds.
A process that outlives the test that started it, or is never reaped, is not counted.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import time
from collections import defaultdict
from pathlib import Path

import pytest

ENV = "TESSERA_CPU_REPORT"


def _cpu() -> tuple[float, float]:
    """This process's CPU-seconds, and those of the processes it reaped: its own children, and those forked for it
    by the fork servers (tests/fork_server.py), whose exit it read."""
    from tests import fork_server

    own, reaped = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, reaped.ru_utime + reaped.ru_stime + fork_server.reaped_cpu_s()


def _forked() -> dict[str, tuple[int, float]]:
    """The fork servers' children reaped so far, by command: (how many, their CPU-seconds)."""
    from tests import fork_server

    return {command: (processes, cpu) for command, (processes, cpu) in list(fork_server.reaped_by_command.items())}


def _forked_since(before: dict[str, tuple[int, float]]) -> dict[str, list[float]]:
    """What ``_forked`` counts now beyond ``before``, for the commands with children reaped since."""
    since = {}
    for command, (processes, cpu) in _forked().items():
        earlier_processes, earlier_cpu = before.get(command, (0, 0.0))
        if processes != earlier_processes:
            since[command] = [processes - earlier_processes, cpu - earlier_cpu]
    return since


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    directory = os.environ.get(ENV)
    if not directory:
        yield
        return
    own, reaped = _cpu()
    forked = _forked()
    start = time.monotonic()
    yield
    own_after, reaped_after = _cpu()
    record = {"test": item.nodeid, "wall": time.monotonic() - start, "own": own_after - own,
              "reaped": reaped_after - reaped, "forked": _forked_since(forked)}
    Path(directory).mkdir(parents=True, exist_ok=True)
    with open(Path(directory) / f"cpu-{os.getpid()}.jsonl", "a") as out:
        out.write(json.dumps(record) + "\n")


def table(directory: Path, by_test: bool, top: int) -> str:
    """The records of ``directory`` summed by module (or by test), most CPU-seconds first."""
    from tests.conftest import lane

    sums: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
    lanes: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])  # tests, wall, CPU
    forked: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])  # command: processes, CPU-s
    for path in sorted(directory.glob("cpu-*.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            key = record["test"] if by_test else record["test"].partition("::")[0]
            for i, field in enumerate(("wall", "own", "reaped")):
                sums[key][i] += record[field]
            for command, (processes, cpu) in record.get("forked", {}).items():
                forked[command][0] += processes
                forked[command][1] += cpu
            counts = lanes[lane(record["test"])]
            counts[0] += 1
            counts[1] += record["wall"]
            counts[2] += record["own"] + record["reaped"]
    total = sum(own + reaped for _, own, reaped in sums.values())
    lines = [f"lane {name}: {tests} test{'' if tests == 1 else 's'}, {wall:,.0f} s of wall time, {cpu:,.0f} CPU-s"
             for name, (tests, wall, cpu) in sorted(lanes.items())]
    lines += [f"forked {command}: {processes:,} process{'' if processes == 1 else 'es'}, {cpu:,.0f} CPU-s "
              f"({cpu / processes:.2f} each)"
              for command, (processes, cpu) in sorted(forked.items())]
    lines += [f"{len(sums)} {'tests' if by_test else 'modules'}, {total:,.0f} CPU-s in all",
              f"{'CPU-s':>8} {'share':>6} {'wall s':>8} {'own':>7} {'reaped':>7}  name"]
    ranked = sorted(sums.items(), key=lambda item: -(item[1][1] + item[1][2]))
    for name, (wall, own, reaped) in ranked[:top]:
        lines.append(f"{own + reaped:8.1f} {(own + reaped) / max(total, 1e-9):6.1%} {wall:8.1f} {own:7.1f} "
                     f"{reaped:7.1f}  {name}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--tests", action="store_true", help="one row per test rather than per module")
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args()
    print(table(args.directory, args.tests, args.top))


if __name__ == "__main__":
    main()
