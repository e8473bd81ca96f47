"""Flake finder: runs pytest N times over the same tests and reports every test that failed at least once.

``make test-repeat`` (N = 3, the e2e tests by default) runs it; ``python -m tests.repeat --count 5 tests/unit``
chooses the count and the tests. A test that fails in any round is listed with its rounds and first error, and
the exit status is 1; a test that passed every round is not named.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from pathlib import Path


def outcomes(junit: Path) -> dict[str, str]:
    """Each test case's id in a JUnit XML report, and its first error line ("" when it passed or skipped)."""
    cases = {}
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        problem = case.find("failure")
        if problem is None:
            problem = case.find("error")
        cases[name] = "" if problem is None else (problem.get("message") or "failed").splitlines()[0][:200]
    return cases


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.repeat", description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=3, help="rounds (default 3)")
    parser.add_argument("tests", nargs="*", help="test paths (default: tests/e2e); pytest's options pass through")
    args, options = parser.parse_known_args(argv)
    pytest_args = [*(args.tests or ["tests/e2e"]), *options]
    if args.count < 1:
        parser.error("--count must be at least 1")
    failed: dict[str, list[tuple[int, str]]] = {}
    seen: set[str] = set()
    with tempfile.TemporaryDirectory(prefix="tessera-repeat-") as scratch:
        for round_ in range(1, args.count + 1):
            junit = Path(scratch) / f"round-{round_}.xml"
            print(f"round {round_} of {args.count}: pytest {' '.join(pytest_args)}", flush=True)
            code = subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                    f"--junitxml={junit}", *pytest_args])
            if not junit.exists():
                print(f"round {round_}: pytest ended with status {code} and wrote no report", file=sys.stderr)
                return 2
            for name, error in outcomes(junit).items():
                seen.add(name)
                if error:
                    failed.setdefault(name, []).append((round_, error))
    print(f"\n{len(seen)} tests, {args.count} rounds: {len(failed)} failed at least once")
    for name, rounds in sorted(failed.items()):
        print(f"FLAKY {name}: failed in round(s) {', '.join(str(r) for r, _ in rounds)} of {args.count}")
        print(f"      {rounds[0][1]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
