"""A decode host's network link cut mid-stream, then restored: nothing lost, nothing leaked (issue 13).

The hosts of tests/e2e/test_multihost_netns.py: each role in its own network namespace behind a veth,
started by its launch script (skipped, with the reason, without root and ``ip netns``). Sixteen
streams (half greedy, half seeded with a frequency penalty) run once without a fault for the
reference, then by 16 clients sending them again and again while decode-1's ``eth0`` goes down once decode-1's
own metrics show a sequence running (not once every stream has text: on loaded cores its first streams may have
ended by then, leaving nothing to resume; nor by the proxy's view of its KV pages, a heartbeat old, whose streams
may all have ended; nor with each stream sent once: under a full test run all of them could end first). No FIN
crosses a downed link, so the proxy learns of it from the missed heartbeats
(``heartbeat_timeout_s``) and resumes its streams on decode-0. Then the link comes back: decode-1's
heartbeats reach the proxy again and are answered with Reregister, so it drops what it held and
registers under a new epoch. Every stream equals the reference, the proxy's view of every worker's
KV pages returns to 0, and decode-1 serves again.
"""
from __future__ import annotations

import asyncio
import re
import subprocess

from tests.conditions import settle
from tests.e2e.fault_scenarios import (
    PAGES_FREED_S, check_nothing_lost, completion_bodies, in_order, run_scenario, wait_until,
)
from tests.e2e.test_multihost_netns import _metric, hosts  # noqa: F401 (the fixture: this module's own hosts)

STREAMS = 16
MAX_TOKENS = 32
BODIES = completion_bodies(STREAMS, MAX_TOKENS)
VICTIM = "decode-1"


def total(url: str, name: str, worker: str | None = None) -> float:
    return sum(v for labels, v in _metric(url, name).items() if worker is None or f'worker_id="{worker}"' in labels)


def set_link(host: str, state: str):
    async def event(run) -> None:
        namespace = run.cluster.net.namespaces[host]
        await asyncio.to_thread(subprocess.run, ["ip", "-n", namespace, "link", "set", "eth0", state],
                                check=True, timeout=30)
    return event


def running(hosts, host: str) -> float:
    """Sequences ``host`` decodes now, from its own metrics server (configs/multi-node: every address, port 9100)."""
    return sum(_metric(f"http://{hosts.net.address(host)}:9100", "tessera_worker_running_sequences").values())


def alive(url: str, role: str | None = None) -> float:
    return sum(v for labels, v in _metric(url, "tessera_proxy_workers_alive").items()
               if role is None or f'role="{role}"' in labels)


def test_a_decode_hosts_link_cut_mid_stream_then_restored_loses_nothing(hosts):  # noqa: F811
    url = hosts.url
    reference = in_order(asyncio.run(run_scenario(hosts, BODIES))[0])
    assert all(not s.lost and s.completion_tokens == MAX_TOKENS for s in reference), reference
    migrations = total(url, "tessera_proxy_migrations_total")

    results, _ = asyncio.run(run_scenario(hosts, BODIES, [
        wait_until(lambda run: run.with_text and running(hosts, VICTIM) > 0, f"a stream under way on {VICTIM}"),
        set_link(VICTIM, "down"),
        wait_until(lambda run: alive(url, "decode") == 1, "the proxy dropped the cut host"),
        set_link(VICTIM, "up"),
        wait_until(lambda run: alive(url) == 4, "the cut host registered again")], steady=STREAMS))
    check_nothing_lost(results, reference, BODIES)
    assert total(url, "tessera_proxy_migrations_total") > migrations, f"nothing resumed off {VICTIM}"
    assert total(url, "tessera_proxy_heartbeats_missed_total", VICTIM) == 1  # counted as the proxy dropped it
    log = (hosts.workdir / "logs" / "proxy.log").read_text()
    epochs = set(re.findall(rf"registered \w+ worker '{VICTIM}' epoch (\d+)", log))
    assert len(epochs) == 2, f"{VICTIM} registered under epochs {epochs}"

    settle(lambda: _metric(url, "tessera_proxy_kv_pages_used"), lambda used: not any(used.values()), PAGES_FREED_S,
           "no KV page in use in the proxy's view of the workers (kv_lease_s at the latest)")
    served = total(url, "tessera_proxy_worker_requests_total", VICTIM)
    again, _ = asyncio.run(run_scenario(hosts, BODIES))
    check_nothing_lost(again, reference, BODIES)
    assert total(url, "tessera_proxy_worker_requests_total", VICTIM) > served, f"{VICTIM} serves no more"
