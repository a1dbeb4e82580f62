"""Test-only `imagebuild`: the real CLI with short waits or a real SIGKILL at a step injected, none read from the env."""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time

from imagebuild.cli import cli
from imagebuild.rollout.plan import Step
from imagebuild.rollout.reconciler import Runtime, StepHook, StepPhase, Timing


def kill_at(phase: str, index: int) -> StepHook:
    """A step hook that SIGKILLs this very process: the real crash, with nothing cleaned up."""

    def hook(step: Step, at: StepPhase) -> None:
        if at == phase and step.index == index:
            os.kill(os.getpid(), signal.SIGKILL)

    return hook


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.e2e.rollout_cli")
    parser.add_argument("--settle-s", type=float, default=Timing.settle_s, help="the lease's settle delay")
    parser.add_argument("--retry-base-s", type=float, default=Timing.retry_base_s, help="a region's backoff base")
    parser.add_argument("--lease-clock-ahead-s", type=float, default=0.0,
                        help="read and write leases as if this many seconds from now (a lease expires without a wait)")
    parser.add_argument("--kill-at", default=None, metavar="PHASE:STEP",
                        help="SIGKILL after step STEP's effect (PHASE effect) or once it is recorded (recorded)")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="imagebuild's own arguments (rollout ...)")
    options = parser.parse_args(argv)
    hook = None
    if options.kill_at:
        phase, _, index = options.kill_at.partition(":")
        if phase not in ("effect", "recorded"):
            parser.error(f"--kill-at {options.kill_at}: PHASE is effect or recorded")
        hook = kill_at(phase, int(index))
    ahead = options.lease_clock_ahead_s
    timing = Timing(settle_s=options.settle_s, retry_base_s=options.retry_base_s,
                    lease_clock=lambda: time.time() + ahead)
    runtime = Runtime(timing, hook)
    cli.main(args=options.args, prog_name="imagebuild", obj=runtime)


if __name__ == "__main__":
    main(sys.argv[1:])
