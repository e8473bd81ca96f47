"""Tenants through the real proxy over HTTP, with scripted workers on real ZeroMQ sockets.

FakeWorkers (``tests.scripted_worker``) stand in for the model: what is tested is
the proxy's admission (auth, limits, queues, fairness), and a worker that
emits a token every ``token_interval_s`` makes a decode slot a known, steady
resource, so a few seconds show the policies apart, which a model on two
shared CPU cores would not.
"""
from __future__ import annotations

import asyncio
import time

import msgspec

from common.config.roles import merge
from common.protocol.wire import cache_salt_of
from common.protocol.wire import StepCostModel
from common.runtime.prometheus_text import total

from proxy.control.limits import SHARED_WINDOW_S
from proxy.tenancy.api_keys import hash_key
from tests.e2e.closed_loops import BODY, RUN_PATIENCE_S, Completions, closed_loops
from tests.e2e.proxy_harness import *  # noqa: F401,F403 -- fixtures, helpers and wire types

# beta's bucket refills one request in 50 s: every request of a test after its first is refused, however slowly
# a busy machine runs the test
TENANTS = [
    {"name": "alpha", "api_key_sha256": [hash_key("sk-alpha")]},
    {"name": "beta", "api_key_sha256": [hash_key("sk-beta")], "requests_per_s": 0.02, "request_burst": 1},
]
HEAVY_AND_LIGHT = [{"name": "heavy", "api_key_sha256": [hash_key("sk-heavy")]},
                   {"name": "light", "api_key_sha256": [hash_key("sk-light")]}]


def start_worker(proxy, worker_id: str, role: str, script, max_num_seqs: int = 0, **options) -> FakeWorker:
    worker = FakeWorker(proxy.endpoint, worker_id, role, script, **options)
    worker.register_msg = msgspec.structs.replace(worker.register_msg, max_num_seqs=max_num_seqs)
    return worker.start_and_wait()


@pytest.fixture
def workers():
    started: list[FakeWorker] = []
    yield started
    for worker in started:
        worker.stop(goodbye=False)


def complete(proxy, key: str | None = None, headers: dict | None = None, **body):
    auth = {"Authorization": f"Bearer {key}"} if key else {}
    return proxy.http.post("/v1/completions", headers={**auth, **(headers or {})},
                           json={"model": MODEL, "prompt": "Tell me about foxes.", "max_tokens": 8, **body})


def test_auth_errors_are_401_in_openai_shape(make_proxy, script, workers):
    proxy = make_proxy(tenancy={"auth_enabled": True, "tenants": [{**TENANTS[0], "priority": "p0"}, TENANTS[1]]})
    prefill, decode = start_worker(proxy, "p0", "prefill", script), start_worker(proxy, "d0", "decode", script)
    workers += [prefill, decode]
    ready(proxy)
    missing = assert_openai_error(complete(proxy), 401, "no API key")
    assert missing["code"] == "invalid_api_key"
    assert_openai_error(complete(proxy, "sk-nope-nope-nope"), 401, "incorrect API key")
    assert_openai_error(proxy.http.post("/v1/chat/completions", headers={"Authorization": "Basic eDp5"},
                                        json={"model": MODEL, "messages": MESSAGES}), 401, "Bearer")
    assert complete(proxy, "sk-alpha").status_code == 200
    assert proxy.http.get("/v1/models").status_code == 200  # only generation is guarded
    assert not prefill.messages(PrefillRequest)[1:]  # the refused ones never reached a worker
    sent_prefill, sent_decode = prefill.messages(PrefillRequest)[0], decode.messages(DecodeRequest)[0]
    assert (sent_prefill.tenant, sent_prefill.priority, sent_prefill.fairness_counter) == ("alpha", 0, 0.0)
    assert (sent_decode.tenant, sent_decode.priority) == ("alpha", 0)
    assert sent_decode.fairness_counter > 0  # the prompt and the first token were charged by then
    assert sent_prefill.cache_salt == sent_decode.cache_salt == cache_salt_of("tenant:alpha")  # alpha's own cache


def test_rate_limited_tenant_gets_429_while_another_is_unaffected(make_proxy, script, workers):
    proxy = make_proxy(tenancy={"auth_enabled": True, "tenants": TENANTS})
    workers += [start_worker(proxy, "p0", "prefill", script, token_interval_s=0.01),
                start_worker(proxy, "d0", "decode", script, token_interval_s=0.01)]
    ready(proxy)
    assert complete(proxy, "sk-beta").status_code == 200
    limited = assert_openai_error(complete(proxy, "sk-beta"), 429, "requests_per_s=0.02", "beta")
    assert limited["code"] == "rate_limit_exceeded"
    assert int(complete(proxy, "sk-beta").headers["retry-after"]) >= 1
    for _ in range(5):  # each of beta's refusals, then one of alpha's requests: served, never held or refused
        assert complete(proxy, "sk-beta").status_code == 429
        assert complete(proxy, "sk-alpha").status_code == 200
    metrics = proxy.http.get("/metrics").text  # a refusal is counted before its 429 is sent
    assert total(metrics, "tessera_proxy_tenant_rejections_total", tenant="beta", reason="rate_limit") == 7
    assert total(metrics, "tessera_proxy_tenant_rejections_total", tenant="alpha") == 0
    assert total(metrics, "tessera_proxy_tenant_requests_total", tenant="alpha", status="ok") == 5


def test_saturated_cluster_times_out_the_queue_with_503(make_proxy, script, workers):
    proxy = make_proxy(tenancy={"queue_timeout_s": 0.5, "prefill_ahead_per_tenant": 1})
    prefill = start_worker(proxy, "p0", "prefill", script)
    workers += [prefill, start_worker(proxy, "d0", "decode", script, max_num_seqs=1, token_interval_s=0.5)]
    ready(proxy)

    async def three() -> list:
        async with httpx.AsyncClient(base_url=proxy.url, timeout=30) as client:
            async def one(delay: float):
                await asyncio.sleep(delay)
                return await client.post("/v1/completions", json={
                    "model": MODEL, "prompt": "Tell me about foxes.", "max_tokens": 4})
            return await asyncio.gather(one(0), one(0.1), one(0.2))

    responses = asyncio.run(three())
    assert sorted(r.status_code for r in responses) == [200, 503, 503]  # one took the slot, whichever came first
    for response in (r for r in responses if r.status_code == 503):  # each waited queue_timeout_s for a decode
        error = assert_openai_error(response, 503, "tenancy.queue_timeout_s=0.5")  # slot after its prefill
        assert error["code"] == "queue_timeout" and response.headers["retry-after"] == "3"
    prefilled = {m.request_id for m in prefill.messages(PrefillRequest)}  # before each answer: final
    settle(lambda: {m.request_id for m in prefill.messages(ReleaseKV)}, prefilled.issubset, HEARTBEAT_TIMEOUT_S,
           "p0 receives a ReleaseKV for every prompt it prefilled (heartbeat_timeout_s bounds a send)")


def test_expired_client_deadline_drops_the_request_unrun(make_proxy, script, workers):
    proxy = make_proxy(tenancy={"prefill_ahead_per_tenant": 1})
    prefill = start_worker(proxy, "p0", "prefill", script)
    workers += [prefill, start_worker(proxy, "d0", "decode", script, max_num_seqs=1, token_interval_s=0.3)]
    ready(proxy)

    async def two() -> list:
        async with httpx.AsyncClient(base_url=proxy.url, timeout=30) as client:
            async def one(delay: float, headers: dict):
                await asyncio.sleep(delay)
                return await client.post("/v1/completions", headers=headers, json={
                    "model": MODEL, "prompt": "Tell me about foxes.", "max_tokens": 3})
            return await asyncio.gather(one(0, {}), one(0.05, {}), one(0.1, {"X-Request-Timeout": "0.3"}))

    first, second, hurried = asyncio.run(two())
    assert first.status_code == 200 and second.status_code == 200
    error = assert_openai_error(hurried, 504, "X-Request-Timeout", "without running")
    assert error["code"] == "deadline_exceeded"
    assert len(prefill.messages(PrefillRequest)) == 2
    assert_openai_error(complete(proxy, headers={"X-Request-Timeout": "soon"}), 400, "X-Request-Timeout")


@pytest.mark.parametrize("policy", ["vtc", "fcfs"])
def test_two_tenants_four_to_one_load(make_proxy, script, workers, policy):
    """24 heavy and 6 light closed-loop streams on 4 decode slots. VTC serves both tenants alike while both wait;
    FCFS serves the streams in turn, so each tenant its share of them. Counted over 120 completions after the
    first 30, the start's burst of one request a stream."""
    proxy = make_proxy(tenancy={"auth_enabled": True, "tenants": HEAVY_AND_LIGHT, "fairness_policy": policy, "prefill_ahead_per_tenant": 2})
    workers += [start_worker(proxy, "p0", "prefill", script),
                start_worker(proxy, "d0", "decode", script, max_num_seqs=4, token_interval_s=0.02)]
    ready(proxy)
    completions = Completions(warm_up=30, measured=120)
    asyncio.run(closed_loops({"sk-heavy": [(proxy.url, 24)], "sk-light": [(proxy.url, 6)]}, completions))
    assert not completions.failures, completions.failures[:3]
    share = completions.share("sk-light")
    print(f"{policy}: light tenant's share of the weighted tokens served {share:.1%} ({completions.served()})")
    if policy == "vtc":
        assert share >= 0.4
    else:
        # its 6 of the 30 streams, served in turn: each ends 4 of the 120 measured completions, give or take one
        assert abs(completions.count("sk-light") - 24) <= 6


def heavy_and_light(make_proxy, script, workers, slots: int, token_interval_s: float, step_ms: list[float],
                    **proxy_options) -> tuple:
    """A proxy with tenants heavy (sk-heavy) and light (sk-light), a prefill worker, and a decode worker of
    ``slots`` slots that emits a token every ``token_interval_s`` and reports a step of ``step_ms[0]`` ms plus
    ``step_ms[1]`` ms a sequence; once the proxy has that model. Its streams run for seconds and none of its tests
    loses a worker, so the proxy keeps heartbeat_timeout_s's default: the harness's 1 s dropped d0 when a loaded
    machine held its heartbeats back (d0, a scripted worker, does not rejoin), and its streams never ended."""
    proxy = make_proxy(**merge({"heartbeat_timeout_s": HEARTBEAT_TIMEOUT_S,
                                "tenancy": {"auth_enabled": True, "tenants": HEAVY_AND_LIGHT}}, proxy_options))
    decode = FakeWorker(proxy.endpoint, "d0", "decode", script, token_interval_s=token_interval_s)
    decode.register_msg = msgspec.structs.replace(decode.register_msg, max_num_seqs=slots)
    decode.step_cost = StepCostModel(small_max_rows=0, small=[], large=[*step_ms, 0.0, 0.0, 0.0])
    workers += [start_worker(proxy, "p0", "prefill", script), decode.start_and_wait()]
    ready(proxy)
    settle(lambda: total(proxy.http.get("/metrics").text, "tessera_proxy_worker_tpot_target_seconds", worker_id="d0"),
           lambda target: target > 0, HEARTBEAT_TIMEOUT_S,
           "d0's step model reaches the proxy with a heartbeat (heartbeat_timeout_s)")
    return proxy, decode


@pytest.mark.parametrize("scope", ["shared", "never"])
def test_decode_admission_holds_the_worker_to_the_tpot_target_while_tenants_share_it(make_proxy, script, workers,
                                                                                     scope):
    """The worker reports a step time of 10 ms + 10 ms a sequence: with a 40 ms target it may run 3 sequences,
    whatever its 16 slots; the rest wait at the proxy, where VTC chooses between the tenants."""
    proxy, decode = heavy_and_light(make_proxy, script, workers, 16, 0.02, [10.0, 10.0],
                                    slo={"tpot_slo_ms": 40.0, "tpot_slo_scope": scope})
    alone = most = 0

    async def heavy_alone() -> None:
        """The heavy tenant's 8 streams, until more than 3 decode at once (or 3 rounds of them ended)."""
        nonlocal alone
        lone = Completions(warm_up=0, measured=24)

        def going() -> bool:
            return alone <= 3 and not lone.done

        async def watch() -> None:
            nonlocal alone
            while going():
                alone = max(alone, decode.decoding())
                await asyncio.sleep(0.005)
        await asyncio.gather(closed_loops({"sk-heavy": [(proxy.url, 8)]}, lone, going), watch())

    both = Completions(warm_up=20, measured=60)  # the warm-up: the first requests, admitted while one tenant

    async def load() -> None:  # alone had arrived, end among the first 20
        nonlocal most

        async def watch() -> None:
            nonlocal most
            while not both.done:
                if both.measuring:
                    most = max(most, decode.decoding())
                await asyncio.sleep(0.005)
        await asyncio.gather(closed_loops({"sk-heavy": [(proxy.url, 8)], "sk-light": [(proxy.url, 2)]}, both),
                             watch())

    asyncio.run(heavy_alone())
    assert alone > 3, "a lone tenant gets every slot, whatever the scope"
    time.sleep(SHARED_WINDOW_S + 0.1)  # past the proxy's window: the heavy tenant alone counts as gone
    asyncio.run(load())
    assert not both.failures, both.failures[:3]
    share = both.share("sk-light")
    print(f"{scope}: at most {most} decoding at once ({alone} alone); light tenant's share {share:.1%} "
          f"({both.served()})")
    if scope == "shared":
        assert most <= 3
        assert share > 0.2  # more than its share of the streams: the waiting happens where VTC chooses
    else:
        assert most > 3


def test_early_rejection_refuses_what_would_miss_the_ttft_target_and_spares_the_light_tenant(make_proxy, script,
                                                                                            workers):
    """Two decode slots, a token every 20 ms, 10 tokens a request: about ten requests a second. The heavy tenant
    keeps 12 requests outstanding, so its new ones would wait well past the 300 ms target and are refused at
    once (429: its own requests are the cause, queued or holding the slots); the light tenant's one stream goes
    ahead of that queue (vtc) and is never refused. The clients run until each outcome was seen ten times."""
    proxy = make_proxy(tenancy={"auth_enabled": True, "tenants": HEAVY_AND_LIGHT, "prefill_ahead_per_tenant": 1},
                       slo={"ttft_slo_ms": 300.0, "early_rejection": True})
    workers += [start_worker(proxy, "p0", "prefill", script),
                start_worker(proxy, "d0", "decode", script, max_num_seqs=2, token_interval_s=0.02)]
    ready(proxy)
    outcomes: dict[str, list] = {"sk-heavy": [], "sk-light": []}

    def going() -> bool:
        heavy = [status for status, _, _ in outcomes["sk-heavy"]]
        return len(outcomes["sk-light"]) < 10 or heavy.count(429) < 10 or heavy.count(200) < 10

    async def loop(client: httpx.AsyncClient, key: str) -> None:
        while going():
            response = await client.post("/v1/completions", headers={"Authorization": f"Bearer {key}"}, json=BODY)
            outcomes[key].append((response.status_code, response.headers.get("retry-after"), response.json()))
            if response.status_code != 200:
                await asyncio.sleep(0.05)  # a client that keeps pushing, whatever Retry-After says

    async def load() -> None:
        async with httpx.AsyncClient(base_url=proxy.url, timeout=30) as client, asyncio.timeout(RUN_PATIENCE_S):
            await asyncio.gather(*(loop(client, "sk-heavy") for _ in range(12)), loop(client, "sk-light"))

    asyncio.run(load())
    heavy = [status for status, _, _ in outcomes["sk-heavy"]]
    light = [status for status, _, _ in outcomes["sk-light"]]
    print(f"heavy: {heavy.count(200)} served, {heavy.count(429)} refused; light: {light.count(200)} served, "
          f"{len(light) - light.count(200)} refused")
    assert set(light) == {200}
    assert set(heavy) <= {200, 429}
    status, retry_after, body = next(o for o in outcomes["sk-heavy"] if o[0] == 429)
    assert int(retry_after) >= 1
    assert "slo.ttft_slo_ms=300" in body["error"]["message"] and "heavy" in body["error"]["message"]
    metrics = proxy.http.get("/metrics").text
    assert 'tessera_proxy_tenant_rejections_total{reason="ttft_target",tenant="heavy"}' in metrics


def heavy_then_light(proxy, decode, holding: tuple[int, int]) -> tuple[list[httpx.Response], float, float]:
    """12 heavy requests; once at least ``holding[0]`` of them decode and they fill what the TPOT target allows,
    one light request, streamed. Checks that at most ``holding[1]`` heavy requests decoded at once until then.
    Returns heavy's responses, how many heavy requests had ended when the light one began to decode (its second
    token: the first comes with its prefill), and heavy's fairness preemptions."""
    reference = complete(proxy, "sk-heavy", max_tokens=10).json()["choices"][0]["text"]
    time.sleep(SHARED_WINDOW_S + 0.1)  # past the proxy's window: the heavy tenant's lone request is forgotten

    def heavy_ended(metrics: str) -> float:  # a choice is counted as it ends, before its last token goes out
        return total(metrics, "tessera_proxy_tenant_requests_total", tenant="heavy", status="ok")

    def decoding_and_capacity() -> tuple[int, float]:
        metrics = proxy.http.get("/metrics").text
        return decode.decoding(), total(metrics, "tessera_proxy_worker_decode_capacity", worker_id="d0")

    async def run() -> tuple[list[httpx.Response], float]:
        async with httpx.AsyncClient(base_url=proxy.url, timeout=30) as client:
            def auth(key: str) -> dict:
                return {"Authorization": f"Bearer {key}"}
            before = heavy_ended((await client.get("/metrics")).text)
            heavy = [asyncio.create_task(client.post("/v1/completions", headers=auth("sk-heavy"), json=BODY))
                     for _ in range(12)]
            most, holding_all = 0, False

            async def watch() -> None:
                nonlocal most
                while not holding_all:
                    most = max(most, decode.decoding())
                    await asyncio.sleep(0.005)
            watcher = asyncio.create_task(watch())
            await asyncio.to_thread(
                settle, decoding_and_capacity, lambda seen: seen[0] >= max(holding[0], seen[1]), PATIENCE_S,
                f"at least {holding[0]} heavy requests decode, as many as d0's capacity (tpot_slo_ms)")
            holding_all = True
            await watcher
            assert most <= holding[1], f"{most} heavy requests decoded at once"
            tokens, ended_first, done = 0, None, False
            async with client.stream("POST", "/v1/completions", headers=auth("sk-light"),
                                     json={**BODY, "stream": True}) as light:
                assert light.status_code == 200, await light.aread()
                async for line in light.aiter_lines():
                    done = done or line == "data: [DONE]"
                    if not line.startswith("data: {"):
                        continue
                    event = json.loads(line[len("data: "):])
                    assert "error" not in event, event
                    tokens += bool(event["choices"])
                    if tokens == 2:
                        ended_first = heavy_ended((await client.get("/metrics")).text) - before
            assert done and ended_first is not None, (done, tokens)
            return await asyncio.gather(*heavy), ended_first

    heavy, ended_first = asyncio.run(run())
    preempted = total(proxy.http.get("/metrics").text, "tessera_proxy_fairness_preemptions_total", tenant="heavy")
    for response in heavy:
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == reference
        assert response.json()["usage"]["completion_tokens"] == 10
    return heavy, ended_first, preempted


@pytest.mark.parametrize("preempt", [True, False])
def test_preempt_for_fairness_makes_room_for_a_tenant_under_its_share(make_proxy, script, workers, preempt):
    """The TPOT target allows 3 sequences (a step of 300 ms + 50 ms a sequence within 460 ms; the model
    overpredicts the scripted worker, so its lag stays about 0: 2 when a loaded machine delays the tokens),
    for every tenant (``tpot_slo_scope: always``). The heavy tenant holds all of them with long requests (a
    token every 250 ms) and has the rest waiting. With
    preempt_for_fairness one heavy request swaps its slot with the light one at once (none of heavy's waiting
    ones takes the slot back); the preempted one finishes later with exactly the output an undisturbed request
    gets. Without it, the light request waits for a heavy one to end."""
    proxy, decode = heavy_and_light(make_proxy, script, workers, 8, 0.25, [300.0, 50.0],
                                    slo={"tpot_slo_ms": 460.0, "tpot_slo_scope": "always"},
                                    tenancy={"preempt_for_fairness": preempt})
    _, ended_first, preempted = heavy_then_light(proxy, decode, holding=(2, 3))
    print(f"tenancy.preempt_for_fairness={preempt}: {ended_first:g} heavy request(s) ended before the light one decoded; "
          f"{preempted:g} preempted")
    if preempt:
        assert preempted == 1  # one swap: no churn, though heavy requests wait for slots too
        assert ended_first == 0  # it decoded at once, in the slot of the one preempted
    else:
        assert preempted == 0
        assert ended_first >= 1  # it waited for a heavy one to end first


def test_a_newcomer_starts_beside_the_burst_a_lone_tenant_started(make_proxy, script, workers):
    """Alone, the heavy tenant gets all 8 slots (``tpot_slo_scope: shared``). When the light tenant comes, the
    target allows 3: the heavy tenant's 8 are past it by its surplus, and the light request starts beside them
    at once, with no preemption, while none of heavy's 4 waiting ones starts until heavy is back within its
    share."""
    proxy, decode = heavy_and_light(make_proxy, script, workers, 8, 0.25, [300.0, 50.0], slo={"tpot_slo_ms": 460.0})
    _, ended_first, preempted = heavy_then_light(proxy, decode, holding=(8, 8))
    print(f"{ended_first:g} heavy request(s) ended before the light one decoded; {preempted:g} preempted")
    assert preempted == 0
    assert ended_first == 0  # it decoded beside the burst, not after a heavy request's end
