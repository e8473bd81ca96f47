"""A resumable stream outlives its proxy on the worker (``common/runtime/proxy_links.py`` ``Owners``): kept running
for its window with its history when the proxy is lost, taken over by the first proxy that asks, ended when its
window closes; and through the real I/O thread, a proxy whose connection closes is lost at once."""
from __future__ import annotations

import pytest
import zmq

from common.protocol import wire
from common.protocol.sampling_params import SamplingParams
from common.runtime.proxy_links import Owners
from common.runtime.worker_io import LinkLost, OrphansExpired
from tests.unit.test_worker_io_proxies import MARK, two_proxies  # noqa: F401 - fixture


def resumable(request_id: str, response_id: str = "chatcmpl-1", tenant: str = "t1") -> wire.DecodeRequest:
    return wire.DecodeRequest(request_id, [1, 2, 3], SamplingParams(max_tokens=4), 0, tenant=tenant,
                              resume_key=response_id, resume_window_s=30.0, resume_context=b"ctx")


def step(request_id: str, token: int, finish: str | None = None) -> wire.TokenDeltas:
    return wire.TokenDeltas([wire.TokenDelta(request_id, [token], f"t{token}", finish_reason=finish)])


@pytest.fixture
def owners():
    clock = [0.0]
    owners = Owners(clock=lambda: clock[0])
    owners.clock = clock
    return owners


def test_a_lost_proxys_resumable_stream_runs_on_and_the_first_proxy_to_ask_gets_all_of_it(owners):
    owners.took(resumable("r1-0"), 0)
    owners.took(wire.DecodeRequest("plain", [1], SamplingParams(max_tokens=4), 0), 0)
    assert owners.route(step("r1-0", 5)) != []
    assert owners.forget(0) == {"plain"}  # failed at once; the resumable one is orphaned
    assert owners.route(step("r1-0", 6)) == []  # kept, sent nowhere
    [found] = owners.take_over(wire.FindStream("chatcmpl-1", "t1"), 1, "w0")
    assert (found.status, found.request_id, found.context) == ("found", "r1-0", b"ctx")
    assert [d.token_ids for d in found.history] == [[5], [6]]  # every step, the delivered one too
    assert [link for link, _ in owners.route(step("r1-0", 7))] == [1]  # live to its new proxy
    # a second client racing for it on another proxy: the first won, and that one is connected
    [late] = owners.take_over(wire.FindStream("chatcmpl-1", "t1"), 0, "w0")
    assert late.status == "owned"


def test_unknown_stream_and_another_tenants_stream_are_absent(owners):
    owners.took(resumable("r1-0"), 0)
    owners.forget(0)
    assert [f.status for f in owners.take_over(wire.FindStream("chatcmpl-unknown"), 1, "w0")] == ["absent"]
    assert [f.status for f in owners.take_over(wire.FindStream("chatcmpl-1", "t2"), 1, "w0")] == ["absent"]
    assert [f.status for f in owners.take_over(wire.FindStream("chatcmpl-1", "t1"), 1, "w0")] == ["found"]


def test_a_window_that_closes_unclaimed_ends_the_stream(owners):
    owners.took(resumable("r1-0"), 0)
    owners.took(resumable("r2-0", "chatcmpl-2"), 0)
    owners.route(step("r2-0", 5, finish="length"))  # finished before its proxy was lost: kept, not to abort
    owners.forget(0)
    owners.clock[0] = 29.0
    assert owners.expire() == set()
    owners.clock[0] = 30.0
    assert owners.expire() == {"r1-0"}  # to abort: its pages are freed
    assert owners.take_over(wire.FindStream("chatcmpl-1"), 1, "w0")[0].status == "absent"
    assert owners.take_over(wire.FindStream("chatcmpl-2"), 1, "w0")[0].status == "absent"
    assert owners.orphans == 0 and len(owners) == 0


def test_a_stream_that_finished_while_orphaned_is_handed_over_whole_and_forgotten(owners):
    owners.took(resumable("r1-0"), 0)
    owners.forget(0)
    owners.route(step("r1-0", 5))
    owners.route(step("r1-0", 6, finish="stop"))
    [found] = owners.take_over(wire.FindStream("chatcmpl-1"), 1, "w0")
    assert [d.finish_reason for d in found.history] == [None, "stop"]
    assert len(owners) == 0 and owners.expire() == set()


def test_a_stream_that_ended_on_its_connected_proxy_is_that_proxys_until_its_window_closes_or_it_is_lost(owners):
    """Its last delta went to proxy 0, which keeps its events for the window: a client that reconnects to another
    proxy hears ``owned`` (503, try again) and reaches proxy 0, rather than a 404 or a stream computed again. Once
    proxy 0 is lost, its events with it, the first proxy to ask gets the whole stream from the worker."""
    owners.took(resumable("r1-0"), 0)
    owners.route(step("r1-0", 5, finish="length"))
    assert [f.status for f in owners.take_over(wire.FindStream("chatcmpl-1", "t1"), 1, "w0")] == ["owned"]
    assert [f.status for f in owners.take_over(wire.FindStream("chatcmpl-1", "t2"), 1, "w0")] == ["absent"]
    owners.clock[0] = 30.0  # its window closed: its proxy let its events go, and so does the worker
    assert [f.status for f in owners.take_over(wire.FindStream("chatcmpl-1"), 1, "w0")] == ["absent"]
    assert len(owners) == 0
    owners.took(resumable("r2-0", "chatcmpl-2"), 0)
    owners.route(step("r2-0", 6))
    owners.route(step("r2-0", 7, finish="stop"))
    owners.clock[0] = 50.0
    owners.forget(0)  # its proxy is lost within the window, its events with it
    assert owners.orphans == 1
    [found] = owners.take_over(wire.FindStream("chatcmpl-2", "t1"), 1, "w0")
    assert (found.status, found.context) == ("found", b"ctx")
    assert [(d.token_ids, d.finish_reason) for d in found.history] == [([6], None), ([7], "stop")]
    assert owners.orphans == 0 and len(owners) == 0  # the new proxy has all of it
    assert [f.status for f in owners.take_over(wire.FindStream("chatcmpl-2"), 0, "w0")] == ["absent"]


def test_a_stream_that_ended_is_found_by_its_own_proxy_and_forgotten_after_its_window(owners):
    """Its proxy asking for it (its events had left its buffer early) gets it back whole; one whose window closed
    before its proxy was lost is forgotten, not orphaned; a periodic sweep forgets the rest."""
    owners.took(resumable("r1-0"), 0)
    owners.route(step("r1-0", 5, finish="stop"))
    [found] = owners.take_over(wire.FindStream("chatcmpl-1"), 0, "w0")
    assert found.status == "found" and len(owners) == 0
    owners.took(resumable("r2-0", "chatcmpl-2"), 0)
    owners.route(step("r2-0", 5, finish="stop"))
    owners.clock[0] = 31.0
    owners.forget(0)
    assert owners.orphans == 0 and len(owners) == 0
    owners.took(resumable("r3-0", "chatcmpl-3"), 1)
    owners.route(step("r3-0", 5, finish="stop"))
    owners.clock[0] = 31.0 + 61.0  # past the window and the sweep's period: the I/O loop's next turn sweeps
    assert owners.expire() == set() and len(owners) == 0


def test_an_abort_from_a_proxy_that_does_not_own_the_request_changes_nothing(owners):
    owners.took(resumable("r1-0"), 0)
    assert not owners.took(wire.Abort("r1-0"), 1)  # proxy 1 took a delta for a stray: the abort is dropped
    assert [link for link, _ in owners.route(step("r1-0", 5))] == [0]
    owners.forget(0)
    assert not owners.took(wire.Abort("r1-0"), 0)  # nor does anything of the lost proxy's end an orphan
    assert owners.orphans == 1
    owners.take_over(wire.FindStream("chatcmpl-1"), 1, "w0")
    assert owners.took(wire.Abort("r1-0"), 1)
    assert owners.route(step("r1-0", 6)) == []


def test_a_proxy_whose_connection_closes_is_lost_and_its_stream_taken_over_by_the_other(two_proxies):  # noqa: F811
    io, (a, b) = two_proxies
    a.send(resumable("r1-0"))
    a.send(wire.DecodeRequest("plain", [1], SamplingParams(max_tokens=4), 0))
    for _ in range(2):
        io.inbox.get(timeout=5)
    io.send(step("r1-0", 5))
    io.send(MARK)
    assert [m for m in a.until_mark() if isinstance(m, wire.TokenDeltas)][0].deltas[0].token_ids == [5]
    a.sock.close(0)  # its process died
    lost = io.inbox.get(timeout=5)
    assert isinstance(lost, LinkLost) and lost.link == 0 and lost.request_ids == {"plain"}
    io.send(step("r1-0", 6))
    b.send(wire.FindStream("chatcmpl-1", "t1"))
    found = b.receive(wire.StreamFound)
    assert found.status == "found"
    io.send(step("r1-0", 7, finish="stop"))
    tokens = [d.token_ids for d in found.history]
    while tokens[-1] != [7]:
        tokens += [d.token_ids for d in b.receive(wire.TokenDeltas).deltas]
    # step 6 is in the history or follows it live (whichever the I/O thread handled first), never both nor neither
    assert tokens == [[5], [6], [7]]
    assert io.owners.orphans == 0


def test_an_orphan_nobody_takes_over_is_given_to_the_compute_loop_to_abort(two_proxies):  # noqa: F811
    io, (a, b) = two_proxies
    a.send(wire.DecodeRequest("r1-0", [1], SamplingParams(max_tokens=4), 0, resume_key="chatcmpl-1",
                              resume_window_s=0.2))
    io.inbox.get(timeout=5)
    a.sock.close(0)
    assert isinstance(io.inbox.get(timeout=5), LinkLost)
    expired = io.inbox.get(timeout=5)
    assert isinstance(expired, OrphansExpired) and expired.request_ids == {"r1-0"}


def test_an_ended_stream_orphaned_past_its_end_window_is_counted_until_it_goes(owners):
    """Handed over (LeaveStream) just after it ended, its proxy lost after the end's window: still an orphan for
    the window from the hand-over, counted as one, taken over whole or expired."""
    owners.took(resumable("r1-0"), 0)
    owners.route(step("r1-0", 5, finish="stop"))
    owners.clock[0] = 10.0
    owners.leave("r1-0", 0)
    assert owners.orphans == 1
    owners.clock[0] = 35.0  # past the end's window (30), within the orphan's (40)
    owners.forget(0)
    assert owners.orphans == 1 and len(owners) == 1
    owners.clock[0] = 40.0
    assert owners.expire() == set()  # ended: nothing to abort
    assert owners.orphans == 0 and len(owners) == 0
