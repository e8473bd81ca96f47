"""The benchmark's configuration: one frozen dataclass, validated when it is built from the flags.

Every check raises ValueError naming the flag to change. A run has one or
more load points; a point is a (request rate, concurrency limit) pair. A
list of rates or of concurrencies makes a sweep (one list at most);
``--find-max-rate`` replaces the list with a search (see ``sweep``).
"""
from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path

from bench.loadgen.client import RequestOptions
from bench.loadgen.metrics import parse_goodput
from bench.loadgen.tenants import Tenant, check_tenants, parse_tenant
from bench.loadgen.workloads import WorkloadOptions, parse_length


@dataclass(frozen=True)
class LoadPoint:
    request_rate: float  # inf: every request at once
    max_concurrency: int | None

    @property
    def label(self) -> str:
        rate = "inf" if math.isinf(self.request_rate) else f"{self.request_rate:g}"
        return f"rate={rate}" + (f",concurrency={self.max_concurrency}" if self.max_concurrency else "")


@dataclass(frozen=True)
class BenchConfig:
    request: RequestOptions  # its model may be None until asked of the server
    workload: WorkloadOptions
    tokenizer: str | None
    num_prompts: int
    request_rates: tuple[float, ...]
    max_concurrencies: tuple[int | None, ...]
    burstiness: float
    tenants: tuple[Tenant, ...]
    seed: int
    percentiles: tuple[float, ...]
    slo: dict
    find_max_rate: bool
    slo_target: float
    search_points: int
    max_duration_s: float
    request_timeout_s: float
    warmup_requests: int
    server_metrics: bool
    scrape_interval_s: float
    result_dir: Path | None
    plots: bool
    progress: bool
    label: str | None
    service_bin_s: float
    input_weight: float
    output_weight: float

    def points(self) -> list[LoadPoint]:
        return [LoadPoint(rate, concurrency) for rate in self.request_rates for concurrency in self.max_concurrencies]


def _numbers(text: str, flag: str, kind) -> tuple:
    try:
        values = tuple(kind(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"{flag} takes a comma-separated list of numbers, got {text!r}") from None
    if not values or any(not v > 0 for v in values):
        raise ValueError(f"{flag} values must be positive, got {text!r}")
    return values


def _headers(pairs: list[str]) -> dict[str, str]:
    headers = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--header takes KEY=VALUE, got {pair!r}")
        headers[key] = value
    return headers


def _extra_body(pairs: list[str]) -> dict:
    body = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--extra-body takes KEY=JSON, got {pair!r}")
        try:
            body[key] = json.loads(value)
        except json.JSONDecodeError:
            body[key] = value  # a bare word is a string
    return body


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    rates = _numbers(args.request_rate, "--request-rate", float)
    concurrencies = _numbers(args.max_concurrency, "--max-concurrency", int) if args.max_concurrency else (None,)
    if len(rates) > 1 and len(concurrencies) > 1:
        raise ValueError("sweep over --request-rate or over --max-concurrency, not both")
    tenants = tuple(parse_tenant(spec) for spec in args.tenant) or (Tenant("default", args.api_key),)
    check_tenants(tenants)
    percentiles = _numbers(args.percentiles, "--percentiles", float)
    if any(p >= 100 for p in percentiles):
        raise ValueError(f"--percentiles must lie in (0, 100), got {args.percentiles!r}")
    slo = parse_goodput(args.goodput)
    if tenants[0].rate is not None and (args.request_rate != "inf" or args.find_max_rate):
        raise ValueError("tenants with their own rate= set the load; leave out --request-rate and --find-max-rate")
    if args.find_max_rate:
        if not slo:
            raise ValueError("--find-max-rate needs an objective: give --goodput")
        if len(rates) > 1 or math.isinf(rates[0]) or len(concurrencies) > 1:
            raise ValueError("--find-max-rate starts from one finite --request-rate and takes no sweep")
    if not 0 < args.slo_target <= 1:
        raise ValueError(f"--slo-target is a fraction in (0, 1], got {args.slo_target}")
    for flag, value in (("--num-prompts", args.num_prompts), ("--max-duration", args.max_duration),
                        ("--request-timeout", args.request_timeout), ("--burstiness", args.burstiness),
                        ("--search-points", args.search_points), ("--service-bin", args.service_bin),
                        ("--scrape-interval", args.scrape_interval)):
        if not value > 0:
            raise ValueError(f"{flag} must be positive, got {value}")
    workload = WorkloadOptions(
        name=args.workload, input_len=parse_length(args.input_len, "--input-len"),
        output_len=parse_length(args.output_len, "--output-len") if args.output_len else None,
        num_prefixes=args.num_prefixes, prefix_len=args.prefix_len,
        dataset_path=Path(args.dataset_path) if args.dataset_path else None,
    )
    request = RequestOptions(
        base_url=args.base_url.rstrip("/"), endpoint=args.endpoint, model=args.model,
        temperature=args.temperature, ignore_eos=args.ignore_eos, include_usage=args.stream_usage,
        headers=_headers(args.header), extra_body=_extra_body(args.extra_body),
    )
    return BenchConfig(
        request=request, workload=workload, tokenizer=args.tokenizer, num_prompts=args.num_prompts,
        request_rates=rates, max_concurrencies=concurrencies, burstiness=args.burstiness, tenants=tenants,
        seed=args.seed, percentiles=percentiles, slo=slo, find_max_rate=args.find_max_rate,
        slo_target=args.slo_target, search_points=args.search_points, max_duration_s=args.max_duration,
        request_timeout_s=args.request_timeout, warmup_requests=args.warmup_requests,
        server_metrics=args.server_metrics, scrape_interval_s=args.scrape_interval,
        result_dir=Path(args.result_dir) if args.result_dir else None, plots=args.plots,
        progress=args.progress, label=args.label, service_bin_s=args.service_bin,
        input_weight=args.input_weight, output_weight=args.output_weight,
    )
