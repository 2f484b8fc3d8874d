"""A scheduler that fails on purpose, for the server's fault test: its
`schedule()` raises once a request that asked for exactly
FAULT_MAX_TOKENS tokens has generated FAULT_AFTER of them. The server loads
it by name (--scheduler-cls tests.failing_scheduler.FailingScheduler), as a
lab plugs in a learner's scheduler."""

from __future__ import annotations

from minivllm.core.scheduler import Scheduler

FAULT_MAX_TOKENS = 77
FAULT_AFTER = 3


class InjectedFault(ValueError):
    """The failure this scheduler raises: a ValueError on purpose, since the
    server must not take a step's failure for a refused request (a 400)."""


class FailingScheduler(Scheduler):
    def schedule(self):
        for seq_group in self.running:
            if (
                seq_group.sampling_params.max_tokens == FAULT_MAX_TOKENS
                and seq_group.get_seqs()[0].get_output_len() >= FAULT_AFTER
            ):
                raise InjectedFault("injected scheduler fault")
        return super().schedule()
