"""A resumed stream's recovery phases at the proxy: the histogram and the one log line (proxy/core/recovery.py).

Scripted workers behind a real proxy; the decode worker goes silent mid-stream as if killed, as in
tests/e2e/test_proxy_migration.py. The benchmark that reads these with real processes is bench/recovery.py.
"""
from __future__ import annotations

import logging

from common.runtime.prometheus_text import samples
from tests.e2e.proxy_harness import *  # noqa: F401,F403 -- fixtures, helpers and wire types
from tests.e2e.test_proxy_migration import collect, lose_the_decode_worker, stream

PHASES = "tessera_proxy_migration_phase_seconds_count"


def recovery_lines(caplog) -> list[dict]:
    """The proxy's recovery lines (``recovery key=value ...``), as dicts of strings."""
    return [dict(pair.split("=", 1) for pair in r.getMessage().split()[1:]) for r in caplog.records
            if r.name == "tessera.proxy.recovery"]


def test_a_resumed_stream_reports_its_redispatch_and_reprefill_once(make_proxy, make_worker, caplog):
    caplog.set_level(logging.INFO, logger="tessera.proxy.recovery")
    _, _, _, errors, workers = lose_the_decode_worker(make_proxy, make_worker, 4, goodbye=False,
                                                      heartbeat_timeout_s=0.5)
    assert not errors
    metrics = workers["proxy"].http.get("/metrics").text
    assert samples(metrics, PHASES) == {'{phase="redispatch"}': 1.0, '{phase="reprefill"}': 1.0}
    [line] = recovery_lines(caplog)
    resumed = workers["p0"].messages(PrefillRequest)[-1]
    assert (line["attempt"], line["lost"], line["outcome"], line["worker"], line["local"]) == \
        ("1", "d0", "recovered", "p0", "no")
    assert int(line["output_tokens"]) == len(resumed.output_token_ids) >= 4
    assert float(line["detected_at"]) <= float(line["redispatched_at"]) <= float(line["recovered_at"])


def test_a_stream_that_never_resumed_reports_nothing(cluster, caplog):
    caplog.set_level(logging.INFO, logger="tessera.proxy.recovery")
    proxy, _, _ = cluster
    with stream(proxy) as r:
        _, _, errors = collect(r.iter_lines())
    assert not errors
    assert not samples(proxy.http.get("/metrics").text, PHASES) and not recovery_lines(caplog)
