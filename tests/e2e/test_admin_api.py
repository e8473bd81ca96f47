"""The admin API over HTTP: who may call it, promotion, canary and rollback as new requests see them, and a worker's
role switch refused or timed out (tests/e2e/test_role_switch.py switches real workers)."""
from __future__ import annotations

import fcntl
import hashlib
import subprocess
import sys
from collections import Counter

import pytest

from common.protocol.wire import SwitchRole
from common.runtime.prometheus_text import samples
from tests.e2e.proxy_harness import *  # noqa: F401,F403 -- fixtures, helpers and wire types

ADMIN_KEY = "admin-secret-key"
NAME = "SmolLM2-135M-Instruct"


@pytest.fixture
def admin_proxy(two_versions, make_proxy, make_worker):
    proxy = make_proxy(security={"admin_api_key_sha256": hashlib.sha256(ADMIN_KEY.encode()).hexdigest()},
                       sessions={"session_pin_max_s": 1.5})
    for version in ("v1", "v2"):
        for role in ("prefill", "decode"):
            make_worker(proxy, f"{role}-{version}", role, model_version=version)
    settle(lambda: proxy.http.get("/v1/models").json()["data"][0]["versions"], lambda versions: len(versions) == 2,
           PATIENCE_S, "/v1/models lists both versions once their workers registered")
    return proxy


def admin(proxy, path: str, key: str | None = ADMIN_KEY, **body):
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    return proxy.http.post(f"/admin/models/{NAME}/{path}", json=body, headers=headers)


def versions_served(proxy, count: int = 40, **headers) -> Counter:
    return Counter(proxy.http.post("/v1/completions", json={"model": NAME, "prompt": "Hi", "max_tokens": 4},
                                   headers=headers).headers["X-Tessera-Model"] for _ in range(count))


def test_the_admin_api_is_off_without_a_key_and_refuses_a_wrong_one(two_versions, make_proxy):
    proxy = make_proxy()
    assert admin(proxy, "rollback").status_code == 403
    keyed = make_proxy(security={"admin_api_key_sha256": hashlib.sha256(ADMIN_KEY.encode()).hexdigest()})
    for key in (None, "wrong"):
        assert admin(keyed, "rollback", key=key).status_code == 401
    assert keyed.http.get("/admin/models").status_code == 401


def test_promote_canary_and_rollback_steer_new_requests(admin_proxy):
    proxy = admin_proxy
    assert versions_served(proxy) == Counter({f"{NAME}@v1": 40})
    canary = admin(proxy, "promote", version="v2", canary_percent=50)
    assert canary.status_code == 200 and canary.json()["canary"] == {"version": "v2", "percent": 50.0}
    split = versions_served(proxy, 200)
    assert 60 < split[f"{NAME}@v2"] < 140
    assert len(versions_served(proxy, 10, **{"X-Session-Id": "one-chat"})) == 1  # a session draws once
    assert admin(proxy, "promote", version="v2").json()["promoted"] == "v2"
    assert versions_served(proxy) == Counter({f"{NAME}@v2": 40})
    rolled = admin(proxy, "rollback").json()
    assert rolled["promoted"] == "v1" and rolled["history"] == []
    assert versions_served(proxy) == Counter({f"{NAME}@v1": 40})
    listing = proxy.http.get("/admin/models", headers={"Authorization": f"Bearer {ADMIN_KEY}"}).json()["data"]
    assert {(r["version"], r["promoted"], r["workers"]) for r in listing} == {("v1", True, 2), ("v2", False, 2)}
    assert admin(proxy, "promote", version="v9").status_code == 400
    assert admin(proxy, "promote", version="v2", canary_percent=150).status_code == 400


def test_the_cli_promotes_and_rolls_back_through_the_admin_api(admin_proxy, tmp_path):
    key_file = tmp_path / "admin.key"
    key_file.write_text(ADMIN_KEY + "\n")
    cli = [sys.executable, "-m", "common.cli.main", "model"]
    target = ["--proxy", admin_proxy.url, "--admin-key-file", str(key_file)]
    done = subprocess.run([*cli, "promote", NAME, "v2", "--canary", "20", *target], capture_output=True, text=True)
    assert done.returncode == 0 and "canary SmolLM2-135M-Instruct@v2 at 20%" in done.stdout, done.stderr
    done = subprocess.run([*cli, "rollback", NAME, *target], capture_output=True, text=True)
    assert done.returncode == 0 and f"{NAME}: promoted v1" in done.stdout
    refused = subprocess.run([*cli, "rollback", NAME, "--proxy", admin_proxy.url, "--admin-key-file", __file__],
                             capture_output=True, text=True)
    assert refused.returncode == 2 and "refused the rollback (401)" in refused.stderr


def test_a_drain_waits_for_the_sessions_pinned_to_the_version_and_sends_it_no_new_one(admin_proxy):
    proxy = admin_proxy
    assert versions_served(proxy, 1, **{"X-Session-Id": "on-v1"}) == Counter({f"{NAME}@v1": 1})
    assert admin(proxy, "promote", version="v2").status_code == 200
    assert admin(proxy, "drain", version="v2").status_code == 400  # the promoted version: not drained
    drained = admin(proxy, "drain", version="v1").json()
    assert drained["pinned_sessions"] == 0  # answered once the pin's time (session_pin_max_s) ran out
    assert versions_served(proxy, 1, **{"X-Session-Id": "on-v1"}) == Counter({f"{NAME}@v2": 1})


def test_a_role_switch_is_refused_as_the_cluster_needs_and_times_out_naming_the_setting(make_proxy, make_worker):
    proxy = make_proxy(security={"admin_api_key_sha256": hashlib.sha256(ADMIN_KEY.encode()).hexdigest()},
                       planner={"role_switch_timeout_s": 0.5})
    make_worker(proxy, "p0", "prefill")
    make_worker(proxy, "d0", "decode")
    scripted = make_worker(proxy, "d1", "decode")  # the scripted worker takes no SwitchRole: the order times out
    ready(proxy)

    def switch(worker_id: str, key: str | None = ADMIN_KEY, **body):
        headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
        return proxy.http.post(f"/admin/workers/{worker_id}/role", json=body, headers=headers)

    assert switch("d1", key=None, role="prefill").status_code == 401
    assert_openai_error(switch("nobody", role="prefill"), 404, "nobody")
    assert assert_openai_error(switch("d1", role="embed"), 400)["param"] == "role"
    assert assert_openai_error(switch("d1", role="prefill", now=True), 400)["param"] == "now"
    assert_openai_error(switch("p0", role="decode"), 409, "last prefill worker", "force")
    same = switch("d1", role="decode")
    assert same.status_code == 200 and same.json()["epoch"] == same.json()["previous_epoch"] == scripted.epoch
    assert_openai_error(switch("d1", role="prefill"), 504, "planner.role_switch_timeout_s=0.5s")
    assert [m for m in scripted.received if isinstance(m, SwitchRole)] == [SwitchRole("d1", "prefill")]
    counts = {labels: value for labels, value in samples(proxy.http.get("/metrics").text,
                                                          "tessera_proxy_role_switches_total").items() if value}
    assert counts == {'{outcome="refused"}': 2, '{outcome="timed_out"}': 1}


def test_a_change_while_the_registry_is_locked_answers_503_naming_the_setting(two_versions, make_proxy):
    """Another process in the middle of a change (its lock on the registry): the admin API's change waits
    http.registry_lock_timeout_s for it, then answers 503 registry_locked, naming the setting, and works once the
    lock is gone."""
    proxy = make_proxy(security={"admin_api_key_sha256": hashlib.sha256(ADMIN_KEY.encode()).hexdigest()},
                       http={"registry_lock_timeout_s": 0.2})
    with open(two_versions.root / ".lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # an open file of its own: the proxy's flock waits for it
        locked = admin(proxy, "promote", version="v2")
    assert locked.status_code == 503
    error = locked.json()["error"]
    assert error["code"] == "registry_locked" and "http.registry_lock_timeout_s" in error["message"]
    assert admin(proxy, "promote", version="v2").json()["promoted"] == "v2"
