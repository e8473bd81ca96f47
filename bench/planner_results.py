"""The planner bench's run file (bench/planner.py ``--json``): what a run's arms depend on, which arms of an earlier
run a new one may keep (``--resume``), writing the file so that no arm is lost, TAC against the best fixed split,
and the file as a markdown table (``report``)."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

# The options an arm's result depends on, with the trace and the step profile (``fingerprint``): a resumed run
# must match them all. ``--splits`` and ``--no-tac`` are left out on purpose: they say which arms to run, and the
# pieces of one run may name different ones.
RUN_SETTINGS = ("workers", "phases", "phase_s", "load", "settle_s", "ttft_ms", "tpot_ms", "time_scale",
                "min_dwell_s", "load_window_s", "max_switching", "drain_s", "tail_s", "seed")


def fingerprint(args, profile_path: Path) -> dict:
    """The settings of ``RUN_SETTINGS`` from ``args``, and the step profile's digest (the simulated workers'
    timing and the trace's rates come from it)."""
    return {**{key: getattr(args, key) for key in RUN_SETTINGS},
            "profile_sha256": hashlib.sha256(profile_path.read_bytes()).hexdigest()[:16]}


def resumable(previous: dict, settings: dict, trace: list[dict], requests: int) -> list[dict]:
    """The arms of an earlier run (a ``--json`` file's content) that a run with ``settings``, whose trace has the
    phases ``trace`` and ``requests`` requests, may keep. A ValueError names what differs, where anything does."""
    if not isinstance(previous, dict) or not isinstance(previous.get("arms", []), list):
        raise ValueError("--resume: the file is not a bench.planner run")
    before = previous.get("settings", {})
    for key, value in settings.items():
        if before.get(key) != value:
            raise ValueError(f"--resume: the earlier run's {key} was {before.get(key)!r}, this run's is {value!r}; "
                             f"resume with the same settings or use another --json")
    if previous.get("trace") != trace or previous.get("requests") != requests:
        raise ValueError("--resume: the earlier run's trace differs from this run's (the code that makes it "
                         "changed); use another --json")
    arms = previous.get("arms", [])
    if not all(isinstance(arm, dict) and {"arm", "planner", "goodput", "phases"} <= arm.keys() for arm in arms):
        raise ValueError("--resume: an arm of the earlier run lacks its name or results")
    return arms


def write_run(path: Path, result: dict) -> None:
    """``result`` to ``path`` whole or not at all: a kill mid-write, or a report reading it, never finds half."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(result, indent=1))
    os.replace(partial, path)


def commit_of_tree() -> str:
    """The commit the bench's checkout is at, ``-dirty`` where its files differ from it (the arm's subprocesses
    import them when it starts); "unknown" outside a git checkout."""
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"], capture_output=True,
                              text=True, cwd=Path(__file__).resolve().parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def summarize(result: dict, phases: list[str]) -> None:
    """Sets, in ``result``, TAC's goodput over the best fixed split's for the whole trace
    (``tac_over_best_fixed``), that split (``best_fixed``), how many of the splits ran (``fixed_splits_run``),
    and per phase TAC's settled goodput over the best fixed split's in that phase
    (``tac_over_phase_best_settled``); a ratio is None where no fixed split served any request within the
    targets. Nothing of these without both a TAC arm and a fixed one. And, where TAC ran, the share of each
    phase's settled requests it served within the targets (``tac_settled_share``): no split can serve more
    than all of them, so this bounds TAC's settled ratio against every split, run or not."""
    fixed = [a for a in result["arms"] if not a["planner"]]
    tac = next((a for a in result["arms"] if a["planner"]), None)
    if tac is not None and all("settled_requests" in p for p in tac["phases"]):
        result["tac_settled_share"] = {phase: round(p["settled_good"] / max(p["settled_requests"], 1), 4)
                                       for phase, p in zip(phases, tac["phases"])}
    if not fixed or tac is None:
        return
    def ratio(tac_value: float, best_value: float) -> float | None:
        return round(tac_value / best_value, 3) if best_value > 0 else None

    best = max(fixed, key=lambda a: a["goodput"])
    result["tac_over_best_fixed"] = ratio(tac["goodput"], best["goodput"])
    result["best_fixed"] = best["arm"]
    result["fixed_splits_run"] = f"{len(fixed)} of {result['settings']['workers'] - 1}"
    result["tac_over_phase_best_settled"] = {
        phase: ratio(tac["phases"][i]["goodput_settled"], max(a["phases"][i]["goodput_settled"] for a in fixed))
        for i, phase in enumerate(phases)}


def report(result: dict) -> str:
    """A run's arms as a markdown table, TAC first, then the fixed splits by goodput: goodput over the whole
    trace and per phase (settled in brackets), switches per phase (the most of one worker in brackets), failed
    requests, the model's goodput for a fixed split, the simulated workers' loop lag against their step, and the
    commit; then lines of TAC's ratios (``summarize``) where both kinds of arm ran, of its share of each phase's
    settled requests where it ran, and of the splits still to run."""
    phases = [p["phase"] for p in result["trace"]]
    head = ["arm", "whole trace", *(f"{p} (settled)" for p in phases), "switches per phase (most of one worker)",
            "failed", "model req/s", "sim lag p99 / step p50", "commit"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for arm in sorted(result["arms"], key=lambda a: (not a["planner"], -a["goodput"])):
        name = f"TAC, from {arm['start_split']}" if arm["planner"] else f"fixed {arm['start_split']}"
        timing = f"{arm['sim_lag_p99_ms']:.1f} / {arm['sim_step_p50_ms']:.1f} ms"
        cells = [name, f"{arm['goodput']:.2f}",
                 *(f"{p['goodput']:.2f} ({p['goodput_settled']:.2f})" for p in arm["phases"]),
                 " / ".join(f"{p['switches']} ({p['most_switches_of_a_worker']})" for p in arm["phases"]),
                 f"{arm['failed']} of {arm['requests']}",
                 "" if arm.get("model_req_s") is None else f"{arm['model_req_s']:.2f}",
                 timing if arm["sim_timing_valid"] else timing + " (not valid)", arm.get("commit", "")]
        rows.append("| " + " | ".join(cells) + " |")
    summary = dict(result)
    summarize(summary, phases)
    if "best_fixed" in summary:
        def times(r: float | None) -> str:
            return "no fixed split served any within the targets" if r is None else f"{r:.2f}x"
        per_phase = ", ".join(f"{p} {times(r)}" for p, r in summary["tac_over_phase_best_settled"].items())
        rows.append(f"\nTAC over the best fixed split run ({summary['best_fixed']}, {summary['fixed_splits_run']} "
                    f"splits run): {times(summary['tac_over_best_fixed'])} over the whole trace; settled, per phase: "
                    f"{per_phase}.")
    if "tac_settled_share" in summary:
        shares = ", ".join(f"{p} {share:.1%}" for p, share in summary["tac_settled_share"].items())
        rows.append(f"\nTAC served within the targets, of each phase's settled requests: {shares} (no split "
                    f"can serve more than all of them).")
    ran = {a["start_split"] for a in result["arms"] if not a["planner"]}
    pending = [s for s in result.get("splits_planned", []) if s not in ran]
    if pending:
        rows.append(f"\nNot run yet ({len(pending)}, in the order planned): {', '.join(pending)}.")
    return "\n".join(rows)
