"""Schedulers that pace the engine's steps, for server tests whose point
needs requests still running at a given moment however fast the machine
is: a client hangs up on a request before it could finish, or enough
requests overlap that the scheduler must preempt. A paced step sleeps
STEP_PAUSE_S before it is scheduled, as a bigger model's step would take
longer; what the step computes is unchanged. The servers load them by
name (--scheduler-cls tests.paced_scheduler.<class>)."""

from __future__ import annotations

import time

from minivllm.core.scheduler import Scheduler
from minivllm.v1.core.sched.scheduler import Scheduler as V1Scheduler

STEP_PAUSE_S = 0.02
# A request that asks for exactly this many tokens paces every step while it
# runs: 400 of them take at least 8 s, long after its client has hung up.
LONG_MAX_TOKENS = 400


class PacedScheduler(Scheduler):
    """Every step takes at least STEP_PAUSE_S."""

    def schedule(self):
        time.sleep(STEP_PAUSE_S)
        return super().schedule()


class LongRequestPacedScheduler(Scheduler):
    """Steps are paced while a request that asked for LONG_MAX_TOKENS runs."""

    def schedule(self):
        if any(g.sampling_params.max_tokens == LONG_MAX_TOKENS for g in self.running):
            time.sleep(STEP_PAUSE_S)
        return super().schedule()


class LongRequestPacedV1Scheduler(V1Scheduler):
    """V1's twin of LongRequestPacedScheduler (in the engine core's process)."""

    def schedule(self):
        if any(request.max_tokens == LONG_MAX_TOKENS for request in self.running):
            time.sleep(STEP_PAUSE_S)
        return super().schedule()
