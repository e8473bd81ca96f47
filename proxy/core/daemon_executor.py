"""An executor of one daemon thread, for the proxy's blocking file work (the conversation store's SQLite, the metering
file's appends).

``concurrent.futures``' threads and asyncio's default executor are joined when the interpreter exits, with no bound: a
call stuck on a hung file system would then hold a stopping proxy for good, after its own shutdown gave up on it. This
thread is not joined: the process exits past a stuck call, which the caller has already reported.
"""
from __future__ import annotations

import queue
import threading
from concurrent.futures import Future


class DaemonExecutor:
    """``submit`` as ``concurrent.futures.Executor``'s (what ``loop.run_in_executor`` calls); one thread, calls in
    order."""

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def submit(self, fn, /, *args, **kwargs) -> Future:
        future: Future = Future()
        self._calls.put((future, fn, args, kwargs))
        return future

    def shutdown(self) -> None:
        """The thread ends after the calls already submitted; this does not wait for them."""
        self._calls.put(None)

    def _run(self) -> None:
        while (call := self._calls.get()) is not None:
            future, fn, args, kwargs = call
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as exc:  # the caller's to handle, as concurrent.futures hands it on
                future.set_exception(exc)
