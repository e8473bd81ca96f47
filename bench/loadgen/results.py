"""The result files: one JSON per load point in ``vllm bench serve``'s layout, and one for the whole run.

``--result-dir DIR`` gets:

- ``point-NN-<label>.json``: one load point, flat, with vLLM's keys (``date``,
  ``backend``, ``model_id``, ``num_prompts``, ``request_rate``, ``burstiness``,
  ``max_concurrency``, ``duration``, ``completed``, ``failed``,
  ``total_input_tokens``, ``total_output_tokens``, ``request_throughput``,
  ``request_goodput``, ``output_throughput``, ``total_token_throughput``,
  ``{mean,median,std,pNN}_{ttft,tpot,itl,e2el}_ms``, and the per-request
  ``input_lens``, ``output_lens``, ``ttfts``, ``itls``, ``latencies``,
  ``start_times``, ``errors``) so tools written for vLLM read it; then ours:
  ``label``, ``slo``, ``slo_attainment``, ``failures_by_kind``,
  ``error_kinds``, ``tenants`` (per-tenant counts, service and TTFT),
  ``tenant_fairness_jain``, ``tenant_service`` (cumulative weighted tokens per
  tenant over time), ``server_metrics`` when scraped, and ``ttft_parts``
  (``bench/loadgen/ttft_parts.py``) from a server that reports them.
- ``result.json``: ``{"tessera_bench": SCHEMA_VERSION, "config", "started",
  "points": [...]}`` plus ``max_rate_meeting_slo`` after a search.

An infinite rate is written as the string ``"inf"`` (as vLLM does); any other
non-finite number as null, so that every file is strict JSON.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

from bench.loadgen.metrics import per_request_lists, summarize
from bench.loadgen.records import RequestRecord
from bench.loadgen.tenants import service_series, tenant_summary
from bench.loadgen.ttft_parts import summarize_parts

if TYPE_CHECKING:  # at run time they would pull httpx (the bench extra) into every `tessera` command
    from bench.loadgen.client import RequestOptions
    from bench.loadgen.config import BenchConfig, LoadPoint

SCHEMA_VERSION = 1
# What any point file has, ours or vLLM's: all that ``compare`` needs.
VLLM_KEYS = {
    "duration": float, "completed": int, "total_input_tokens": int, "total_output_tokens": int,
    "request_throughput": float, "output_throughput": float, "total_token_throughput": float,
}
# What every point of ours has besides.
TESSERA_KEYS = {
    "date": str, "backend": str, "model_id": str, "num_prompts": int, "burstiness": float, "failed": int,
    "label": str, "slo": dict, "failures_by_kind": dict, "tenants": dict, "tenant_service": dict,
    "input_lens": list, "output_lens": list, "ttfts": list, "itls": list, "latencies": list, "errors": list,
    "mean_ttft_ms": (float, type(None)), "median_ttft_ms": (float, type(None)), "mean_tpot_ms": (float, type(None)),
    "mean_itl_ms": (float, type(None)), "mean_e2el_ms": (float, type(None)),
}


def run_config(config: BenchConfig, request: RequestOptions) -> dict:
    return {
        "base_url": request.base_url, "endpoint": request.endpoint, "model": request.model, "label": config.label,
        "workload": {k: (str(v) if isinstance(v, Path) else v)
                     for k, v in dataclasses.asdict(config.workload).items()},
        "tokenizer": config.tokenizer, "num_prompts": config.num_prompts,
        "request_rates": list(config.request_rates), "max_concurrencies": list(config.max_concurrencies),
        "burstiness": config.burstiness, "seed": config.seed, "percentiles": list(config.percentiles),
        "slo": config.slo, "slo_target": config.slo_target if config.find_max_rate else None,
        "tenants": [dataclasses.asdict(t) | {"api_key": None} for t in config.tenants],  # keys stay private
        "max_duration_s": config.max_duration_s, "request_timeout_s": config.request_timeout_s,
        "temperature": request.temperature, "ignore_eos": request.ignore_eos,
    }


def point_result(config: BenchConfig, request: RequestOptions, point: LoadPoint, records: list[RequestRecord],
                 duration_s: float, server: dict | None, scrapes: tuple[str, str] | None = None) -> dict:
    """``scrapes``: the server's /metrics before and after the point, for the TTFT parts."""
    result = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": "openai-chat" if request.chat else "openai",
        "label": config.label or point.label, "point": point.label,
        "model_id": request.model, "tokenizer_id": config.tokenizer, "workload": config.workload.name,
        "num_prompts": config.num_prompts, "num_sent": len(records),
        "request_rate": point.request_rate, "burstiness": config.burstiness,
        "max_concurrency": point.max_concurrency, "slo": config.slo,
    }
    result |= summarize(records, duration_s, config.percentiles, config.slo)
    service = service_series(records, config.tenants, duration_s, config.service_bin_s, config.input_weight,
                             config.output_weight)
    result |= tenant_summary(records, config.tenants, config.percentiles, service)
    if server is not None:
        result["server_metrics"] = server
        if "spec_decode_acceptance_rate" in server:
            result["spec_decode_acceptance_rate"] = server["spec_decode_acceptance_rate"]
    if scrapes is not None and (parts := summarize_parts(*scrapes, result["mean_ttft_ms"])) is not None:
        result["ttft_parts"] = parts
    result |= per_request_lists(records)
    return result


def check_point(point: dict, ours: bool = True) -> None:
    """Raise ValueError naming the first key that is missing or of the wrong type."""
    for key, kind in (VLLM_KEYS | TESSERA_KEYS if ours else VLLM_KEYS).items():
        if key not in point:
            raise ValueError(f"the result has no {key!r}")
        # JSON has one number type: an int where a float is expected is fine.
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if not isinstance(point[key], kinds) and not (float in kinds and isinstance(point[key], int)):
            raise ValueError(f"the result's {key!r} is {type(point[key]).__name__}, not {kind}")


def _strict(value):
    if isinstance(value, float) and not math.isfinite(value):
        return "inf" if value == math.inf else None
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_strict(v) for v in value]
    return value


def write_results(run: dict, result_dir: Path) -> list[Path]:
    result_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for n, point in enumerate(run["points"]):
        slug = re.sub(r"[^A-Za-z0-9.]+", "-", point["point"])
        paths.append(result_dir / f"point-{n:02d}-{slug}.json")
        paths[-1].write_text(json.dumps(_strict(point), allow_nan=False))
    paths.append(result_dir / "result.json")
    paths[-1].write_text(json.dumps(_strict({"tessera_bench": SCHEMA_VERSION, **run}), allow_nan=False, indent=1))
    return paths


def load_points(path: Path) -> list[dict]:
    """The points of a run file, or the one point of a point file (ours or vLLM's)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"cannot read {path}: {error}") from None
    points = data.get("points", [data]) if isinstance(data, dict) else None
    if not points:
        raise ValueError(f"{path} is neither a tessera bench result nor a vllm bench serve result")
    for point in points:
        try:
            check_point(point, ours=False)
        except ValueError as error:
            raise ValueError(f"{path}: {error}") from None
    return points
