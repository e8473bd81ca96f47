"""``tessera bench`` flags -> BenchConfig, the max-rate search, and the workloads."""
import asyncio
import math
from types import SimpleNamespace

import pytest

from bench.loadgen.benchmark import search_max_rate
from bench.loadgen.config import LoadPoint, config_from_args
from bench.loadgen.workloads import WorkloadOptions, build_workload, load_sharegpt, parse_length
from common.cli.main import build_parser, main


def config(*flags):
    return config_from_args(build_parser().parse_args(["bench", *flags]))


def test_defaults_and_a_rate_sweep():
    c = config("--request-rate", "0.5,1,2", "--goodput", "ttft:500", "e2el:3000", "--header", "X-A=b")
    assert [p.label for p in c.points()] == ["rate=0.5", "rate=1", "rate=2"]
    assert c.slo == {"ttft": 500, "e2el": 3000} and c.request.headers == {"X-A": "b"}
    assert c.tenants[0].name == "default" and c.request.model is None and c.request.ignore_eos
    assert config().points() == [LoadPoint(math.inf, None)]


def test_extra_body_fields_reach_every_request():
    from bench.loadgen.client import request_body
    from bench.loadgen.workloads import RequestSpec

    c = config("--extra-body", "speculative=off", "--extra-body", "num_speculative_tokens=2", "--model", "m")
    assert c.request.extra_body == {"speculative": "off", "num_speculative_tokens": 2}
    body = request_body(c.request, RequestSpec("hi", None, 4))
    assert body["speculative"] == "off" and body["num_speculative_tokens"] == 2 and body["max_tokens"] == 4


def test_a_concurrency_sweep():
    c = config("--max-concurrency", "1,4", "--workload", "realistic", "--endpoint", "/v1/chat/completions")
    assert [p.label for p in c.points()] == ["rate=inf,concurrency=1", "rate=inf,concurrency=4"]
    assert c.request.chat


@pytest.mark.parametrize("flags, message", [
    (["--request-rate", "1,2", "--max-concurrency", "1,2"], "not both"),
    (["--request-rate", "fast"], "--request-rate"),
    (["--request-rate", "0"], "positive"),
    (["--find-max-rate"], "--goodput"),
    (["--find-max-rate", "--goodput", "ttft:100"], "finite"),
    (["--tenant", "name=a,rate=1", "--request-rate", "2"], "rate="),
    (["--percentiles", "50,100"], "--percentiles"),
    (["--slo-target", "1.5"], "--slo-target"),
    (["--max-duration", "0"], "--max-duration"),
    (["--input-len", "9-3"], "--input-len"),
    (["--header", "novalue"], "--header"),
    (["--extra-body", "novalue"], "--extra-body"),
])
def test_bad_flags_name_the_flag(flags, message):
    with pytest.raises(ValueError, match=message):
        config(*flags)


def test_bad_flags_exit_with_status_2(capsys):
    assert main(["bench", "--find-max-rate"]) == 2
    assert "--goodput" in capsys.readouterr().err


def test_search_brackets_then_bisects():
    limit = 3.3
    tried = []

    async def measure(point):
        tried.append(point.request_rate)
        return {"slo_attainment": 1.0 if point.request_rate <= limit else 0.5}

    settings = SimpleNamespace(request_rates=(1.0,), max_concurrencies=(None,), search_points=8, slo_target=0.9)
    best = asyncio.run(search_max_rate(settings, measure))
    assert tried[:3] == [1.0, 2.0, 4.0] and tried[3] == 3.0
    assert best <= limit < best * 1.1 + 1e-9 and len(tried) <= 8


def test_search_that_never_passes_returns_none():
    async def measure(point):
        return {"slo_attainment": 0.0}

    settings = SimpleNamespace(request_rates=(8.0,), max_concurrencies=(None,), search_points=3, slo_target=0.9)
    assert asyncio.run(search_max_rate(settings, measure)) is None


class FakeTokens:
    """A 100-token vocabulary; text is one token per word."""

    def random_ids(self, rng, length):
        return [int(t) for t in rng.integers(0, 100, size=length)]

    def count(self, text):
        return len(text.split())

    def decode(self, ids):
        return " ".join(f"w{t}" for t in ids)


def test_parse_length():
    assert parse_length("256", "--input-len") == (256, 256)
    assert parse_length("16-32", "--input-len") == (16, 32)


def test_random_workload_lengths_and_seeding():
    options = WorkloadOptions("random", input_len=(10, 20), output_len=(4, 4))
    specs = build_workload(options, 50, 0, FakeTokens(), as_text=False)
    assert all(10 <= len(s.prompt) == s.input_len <= 20 and s.output_len == 4 for s in specs)
    assert specs == build_workload(options, 50, 0, FakeTokens(), as_text=False)
    assert specs != build_workload(options, 50, 1, FakeTokens(), as_text=False)
    # Another draw (the next load point) gets fresh prompts of the same kind.
    other = build_workload(options, 50, 0, FakeTokens(), as_text=False, draw=1)
    assert other != specs and all(10 <= s.input_len <= 20 for s in other)
    as_text = build_workload(options, 3, 0, FakeTokens(), as_text=True)
    assert all(isinstance(s.prompt, str) for s in as_text)
    with pytest.raises(ValueError, match="--tokenizer"):
        build_workload(options, 3, 0, None, as_text=False)


def test_shared_prefix_workload_reuses_each_prefix():
    options = WorkloadOptions("shared-prefix", input_len=(5, 5), num_prefixes=3, prefix_len=20)
    specs = build_workload(options, 12, 0, FakeTokens(), as_text=False)
    prefixes = {tuple(s.prompt[:20]) for s in specs}
    assert len(prefixes) == 3 and all(len(s.prompt) == 25 for s in specs)
    assert len({tuple(s.prompt) for s in specs}) == 12


def test_shipped_text_workloads():
    realistic = build_workload(WorkloadOptions("realistic"), 60, 0, None, as_text=True)
    assert len({s.prompt for s in realistic}) >= 50 and all(s.input_len is None for s in realistic)
    copy = build_workload(WorkloadOptions("copy"), 8, 0, FakeTokens(), as_text=True)
    for spec in copy:
        passage = spec.prompt.split("\n\n", 1)[1]
        assert spec.output_len == len(passage.split()) + 16 and spec.input_len == len(spec.prompt.split())
    fixed = build_workload(WorkloadOptions("realistic", output_len=(7, 7)), 5, 0, None, as_text=True)
    assert {s.output_len for s in fixed} == {7}


def test_sharegpt_file(tmp_path):
    path = tmp_path / "sg.json"
    path.write_text('[{"conversations": [{"from": "human", "value": "hi there"}, {"from": "gpt", "value": "a b c"}]},'
                    ' {"conversations": [{"from": "gpt", "value": "orphan"}]}]')
    assert load_sharegpt(path) == [("hi there", "a b c")]
    specs = build_workload(WorkloadOptions("sharegpt", dataset_path=path), 3, 0, FakeTokens(), as_text=True)
    assert [(s.prompt, s.input_len, s.output_len) for s in specs] == [("hi there", 2, 3)] * 3
    with pytest.raises(ValueError, match="--dataset-path"):
        load_sharegpt(None)

