"""The proxy's worker link (``proxy.cluster.worker_link.WorkerLink``) against a real DEALER over TCP."""
from __future__ import annotations

import asyncio
import time

import zmq

from common.protocol.wire import Abort, ReleaseKV, decode, encode
from proxy.cluster.worker_link import WorkerLink

PAD = "x" * 10_000
PATIENCE_S = 60  # a bound on waits for a condition, so that a broken link fails rather than hangs; never a timing


async def until(condition, what: str) -> None:
    deadline = time.monotonic() + PATIENCE_S
    while not condition():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.01)


async def introduced(dealer, heard: list) -> None:
    """The worker's first message reached the link, which can address it from then on."""
    dealer.send_multipart(encode(ReleaseKV("hello")))
    await until(lambda: heard, "the link never read the worker's first message")


async def linked(on_frames, send_timeout_s: float = 5.0, hwm: int = 1000):
    link = WorkerLink("tcp://127.0.0.1:*", on_frames, send_timeout_s=send_timeout_s)
    await link.start()
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.IDENTITY, b"w0")
    dealer.setsockopt(zmq.RCVHWM, hwm)
    dealer.connect(link.endpoint)
    return link, context, dealer


def test_a_reply_to_a_send_is_read_at_once_though_the_send_may_take_the_descriptor_edge():
    """Each message the link receives makes it send one back, and the worker answers each at once: nothing else
    signals the descriptor, so a message whose edge a send consumed would wait for the next heartbeat."""
    async def run():
        received: list[bytes] = []
        link = None

        def on_frames(identity: bytes, frames: list[bytes]) -> None:
            received.append(identity)
            link.send(identity.decode(), Abort(decode(frames).request_id))

        link, context, dealer = await linked(on_frames)
        try:
            dealer.send_multipart(encode(ReleaseKV("r0")))
            loop = asyncio.get_running_loop()
            for i in range(1, 200):  # ping-pong: the worker answers each of the link's sends
                reply = await loop.run_in_executor(
                    None, lambda: dealer.poll(PATIENCE_S * 1000) and dealer.recv_multipart())
                assert reply, f"no reply {i}: the link did not read the worker's message"
                dealer.send_multipart(encode(ReleaseKV(f"r{i}")))
            await until(lambda: len(received) >= 200, f"only {len(received)} of 200 messages were read")
            assert len(received) == 200
        finally:
            await link.close()
            dealer.close(linger=0)
            context.term()
    asyncio.run(run())


def test_sends_a_worker_cannot_take_yet_wait_in_order_and_go_out_when_it_reads():
    async def run():
        heard = []
        link, context, dealer = await linked(lambda identity, frames: heard.append(identity), hwm=4)
        try:
            await introduced(dealer, heard)
            for i in range(3000):  # 30 MB: more than the pipes and socket buffers hold, so some sends wait
                link.send("w0", Abort(f"r{i}-{PAD}"))
            assert link._pending, "every send was taken at once: nothing exercised the waiting path"
            ids = []
            loop = asyncio.get_running_loop()
            while len(ids) < 3000:
                frames = await loop.run_in_executor(
                    None, lambda: dealer.poll(PATIENCE_S * 1000) and dealer.recv_multipart())
                assert frames, f"only {len(ids)} of 3000 messages came"
                ids.append(decode(frames).request_id)
            assert ids == [f"r{i}-{PAD}" for i in range(3000)]
        finally:
            await link.close()
            dealer.close(linger=0)
            context.term()
    asyncio.run(run())


def test_a_send_not_taken_within_the_timeout_is_dropped(caplog):
    async def run():
        heard = []
        link, context, dealer = await linked(lambda identity, frames: heard.append(identity), send_timeout_s=0.3,
                                             hwm=1)
        try:
            await introduced(dealer, heard)
            for i in range(3000):  # the worker never reads
                link.send("w0", Abort(f"r{i}-{PAD}"))
            assert link._pending, "every send was taken at once: nothing exercised the waiting path"
            await until(lambda: not link._pending, "the sends the worker never took were not dropped")
            assert "not taken within heartbeat_timeout_s=0.3s" in caplog.text
        finally:
            await link.close()
            dealer.close(linger=0)
            context.term()
    asyncio.run(run())
