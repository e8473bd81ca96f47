"""``tessera up``'s supervisor: a process that exits on its own is restarted, with backoff."""
from common.cli.local_cluster import Supervisor


class Processes:
    """What the supervisor uses of a LocalCluster: which processes exited, and starting one again."""

    def __init__(self, *names: str) -> None:
        self.codes = {name: None for name in names}
        self.started: list[str] = []

    def dead(self) -> dict[str, int]:
        return {name: code for name, code in self.codes.items() if code is not None}

    def restart(self, name: str) -> None:
        self.codes[name] = None
        self.started.append(name)


def test_an_exited_process_is_restarted_after_its_backoff_and_the_rest_are_left_alone():
    procs = Processes("proxy", "prefill-0", "decode-0")
    supervisor = Supervisor(procs, backoff_s=1.0, max_backoff_s=8.0, stable_s=60.0)
    assert supervisor.check(0.0) == []
    procs.codes["decode-0"] = -9
    assert supervisor.check(10.0) == ["decode-0 exited with code -9; restarting it in 1s"]
    assert supervisor.check(10.5) == [] and procs.started == []
    assert supervisor.check(11.0) == ["decode-0 restarted (restart 1)"]
    assert procs.started == ["decode-0"] and not procs.dead()


def test_a_process_that_keeps_exiting_backs_off_exponentially_then_starts_over_once_stable():
    procs = Processes("prefill-0")
    supervisor = Supervisor(procs, backoff_s=1.0, max_backoff_s=4.0, stable_s=60.0)
    now, delays = 0.0, []
    for _ in range(5):
        procs.codes["prefill-0"] = 1
        line = supervisor.check(now)[0]
        delays.append(float(line.rsplit(" ", 1)[1].rstrip("s")))
        now += delays[-1]
        supervisor.check(now)
    assert delays == [1.0, 2.0, 4.0, 4.0, 4.0]
    procs.codes["prefill-0"] = 1
    assert supervisor.check(now + 61.0) == ["prefill-0 exited with code 1; restarting it in 1s"]
    assert supervisor.restarts == {"prefill-0": 5}
