"""The proxy's executor for blocking file work (proxy/core/daemon_executor.py): calls run in order and hand back
their results and errors through ``loop.run_in_executor``, and a call stuck for good does not hold the process's
exit (the default executor's and ``concurrent.futures``' threads are joined at exit, without bound)."""
from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from proxy.core.daemon_executor import DaemonExecutor


def test_calls_run_in_order_and_hand_back_results_and_errors():
    executor = DaemonExecutor("test")
    done: list[int] = []

    async def run() -> None:
        loop = asyncio.get_running_loop()
        assert await asyncio.gather(*(loop.run_in_executor(executor, lambda i=i: done.append(i) or i * i)
                                      for i in range(5))) == [0, 1, 4, 9, 16]
        with pytest.raises(ZeroDivisionError):
            await loop.run_in_executor(executor, lambda: 1 / 0)

    asyncio.run(run())
    assert done == [0, 1, 2, 3, 4]
    executor.shutdown()


def test_a_stuck_call_does_not_hold_the_exit():
    script = ("import threading, time\nfrom proxy.core.daemon_executor import DaemonExecutor\n"
              "e = DaemonExecutor('stuck')\ne.submit(threading.Event().wait)\ne.shutdown()\nprint('out')\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout == "out\n", done.stderr
