"""Role switching at run time: a worker moves between ``prefill``, ``decode`` and ``both`` with its model kept loaded.

The proxy orders one with SwitchRole (``proxy/cluster/role_switches.py``: the admin API's orders and the planner's).
The worker then:

1. stops taking work (its heartbeats say draining) and lets what runs finish, up to ``drain_timeout_s``, as for a
   LoadModel (``model_swap.py``): its decode streams run on, a prefill worker's lent pages wait for their pulls and
   the ReleaseKV after each; what is left then goes back to the proxy (retryable: it resumes elsewhere, exactly as
   after a drain);
2. says Goodbye under its epoch;
3. hands what it holds (the engine with its prefix cache, the KV transfer agent, metrics, the health server, tracing,
   the cores) to a handler of the new role (``WorkerBase.adopt``) under a new epoch;
4. calibrates the step costs the new role needs and the old one never measured (``common/engine/calibration.py``,
   within ``engine.steps.calibration_s``: a former prefill worker's decode steps, a former decode worker's prompt
   steps),
   so that its first heartbeat in the new role carries a step model the proxy can size its capacity by, as at load;
   a fit it already has is not measured again. Then it registers again.

The runtime knows no role: ``serve`` is given ``adopters`` (role -> the function that builds that role's handler
around the running one), which the worker command (``common/cli/worker_command.py``) gathers from every role's
command. An order for the role the worker has is answered by registering again (no drain). A signal during a switch
wins: the worker drains and exits. A worker that holds no model (standing by) or is loading another one switches
nothing (the proxy's order times out).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import replace

from common.engine.calibration import calibrate
from common.engine.tensor_parallel import RankGroupBroken
from common.protocol import wire
from common.runtime.telemetry import relabel_logs
from common.runtime.worker_contracts import Adopt, RoleHandler

log = logging.getLogger(__name__)


class RoleSwitch:
    """The worker loop's side of SwitchRole (``worker_runtime.serve`` calls ``take`` and, at ``check_at``, ``act``)."""

    def __init__(self, config, handler: RoleHandler, signalled: list[int], adopters: Mapping[str, Adopt]) -> None:
        self.config = config
        self.handler = handler  # the handler serving now; ``act`` returns its successor after a switch
        self.signalled = signalled
        self.adopters = adopters
        self.io = None  # the WorkerIO, set by serve once built (it sends the Goodbye and the Register)
        self.pending: str | None = None  # the role asked for, taken once the running work finished
        self.switch_by = 0.0  # monotonic: when the running work is given back to the proxy, pending a switch
        self.check_at = float("inf")  # when serve next calls ``act``

    def take(self, msg: wire.SwitchRole, swapping: bool) -> None:
        """A SwitchRole; ``swapping``: a model load is pending (``ModelSwitch``), which this does not interrupt."""
        handler = self.handler
        if msg.worker_id != self.config.worker_id:
            log.warning("dropped a SwitchRole for worker %r: this worker is %r", msg.worker_id, self.config.worker_id)
        elif msg.role not in self.adopters:
            log.warning("the proxy asked this worker to serve as %s; its command knows the roles %s", msg.role,
                        ", ".join(self.adopters) or "none")
        elif self.signalled or swapping or handler.engine is None:
            log.warning("the proxy asked this worker to serve as %s; it %s", msg.role,
                        "is shutting down" if self.signalled else "is loading a model" if swapping
                        else "holds no model now")
        elif self.pending is not None:
            log.info("the proxy asked this worker to serve as %s instead of %s: it switches to that once drained",
                     msg.role, self.pending)
            self.pending = msg.role
        elif msg.role == handler.role:
            log.info("the proxy asked this worker to serve as %s, which it does: registering again", msg.role)
            self.io.send(self.io.registration)
        else:
            log.info("the proxy asked this worker to serve as %s instead of %s: draining (up to drain_timeout_s=%gs),"
                     " then switching", msg.role, handler.role, self.config.drain_timeout_s)
            self.pending = msg.role
            self.switch_by = time.monotonic() + self.config.drain_timeout_s
            handler.draining = self.io.draining = True
            self.check_at = 0.0

    def act(self) -> RoleHandler:
        """A switch that is due (the running work finished, or its drain time is up); the handler serving now."""
        if self.signalled:  # shutting down: no switch (serve drains and exits)
            self.check_at = float("inf")
            return self.handler
        if self.pending is None:
            self.check_at = float("inf")
            return self.handler
        if self.handler.busy():
            if time.monotonic() < self.switch_by:
                return self.handler
            log.warning("switching roles: drain_timeout_s=%gs passed with requests still held; failing them back to "
                        "the proxy", self.config.drain_timeout_s)
        role, self.pending = self.pending, None
        self.check_at = float("inf")
        self.handler = self._switch(role)
        return self.handler

    def _switch(self, role: str) -> RoleHandler:
        old = self.handler
        old.fail_all(f"the worker is switching to role {role}")
        old.tick()  # queues the failures
        self.io.leave(f"switching from role {old.role} to {role}")
        new = self.adopters[role](old, replace(old.config, role=role))
        new.new_epoch()  # pages lent under the old epoch are refused from now on
        self._calibrate(new)
        self.io.serve_role(role)
        new.draining = self.io.draining = False
        self.io.registration = new.registration()
        self.io.rejoin()
        relabel_logs(role=role)
        new.metrics.role_switches.labels(role).inc()
        log.info("worker %s: now serving as %s (epoch %d), its model kept loaded", self.config.worker_id, role,
                 new.epoch)
        return new

    def _calibrate(self, handler: RoleHandler) -> None:
        """The new role's step costs that ``handler``'s engine has no fit of yet, measured as at load (its counters
        kept: they count traffic, not calibration)."""
        try:
            calibrated = calibrate(handler.engine, self.config.engine.steps.calibration_s,
                                   decode=handler.role != "prefill", prompts=handler.role != "decode",
                                   cores=handler.cores)
        except RankGroupBroken:
            raise  # the worker ends (worker_runtime)
        except RuntimeError as exc:  # something of the old role still held: the fit then comes from traffic
            log.warning("no step-cost calibration for the role %s: %s", handler.role, exc)
            return
        if calibrated.decode_steps or calibrated.prompt_steps:
            log.info("step-cost calibration for the role %s: %s", handler.role,
                     calibrated.summary(handler.engine.step_timer))
