"""Stand-in for imagebuild.rollout_gates until the gates branch merges: soak, signature and approval only.

Same names and shapes as the gates interface (evaluate(spec, ctx) -> GateResult); any other
gate kind FAILS, saying this build lacks it, so a release that needs it never passes silently.
Delete this module once rollout_gates.py is on main.
"""
from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from enum import Enum

from .release import ApprovalGate, GateSpec, Region, SignatureGate, SoakGate
from .trust import TrustConfig


class GateOutcome(str, Enum):
    PASSED = "passed"
    FAILED = "failed"
    WAITING = "waiting"


@dataclass(frozen=True)
class GateResult:
    gate: str
    region: str | None
    outcome: GateOutcome
    detail: str
    checked_at: str
    retry_in_s: float | None = None


@dataclass(frozen=True)
class GateContext:
    wave: str
    region: Region
    image: str
    digest: str
    channels: tuple[str, ...]
    moved_at: float
    approvals: tuple[str, ...]
    trust: TrustConfig
    now: float


def _stamp(now: float) -> str:
    return dt.datetime.fromtimestamp(now, dt.timezone.utc).isoformat(timespec="seconds")


def evaluate(spec: GateSpec, ctx: GateContext) -> GateResult:
    def result(outcome: GateOutcome, detail: str, retry: float | None = None) -> GateResult:
        return GateResult(spec.kind, ctx.region.name, outcome, detail, _stamp(ctx.now), retry)

    if isinstance(spec, SoakGate):
        left = ctx.moved_at + spec.seconds - ctx.now
        if left > 0:
            return result(GateOutcome.WAITING, f"soaking: {left:.0f}s of {spec.seconds:g}s left", min(left, 5.0))
        return result(GateOutcome.PASSED, f"soaked {spec.seconds:g}s")
    if isinstance(spec, ApprovalGate):
        if ctx.wave in ctx.approvals:
            return result(GateOutcome.PASSED, "approved")
        return result(GateOutcome.WAITING, f"waiting for `imagebuild rollout approve ID --wave {ctx.wave}`", 2.0)
    if isinstance(spec, SignatureGate):
        from .verify import Verifier

        with Verifier(ctx.trust, cache_ttl_seconds=0) as verifier:
            verdict = verifier.verify(ctx.image)
        if verdict.allowed and verdict.digest == ctx.digest:
            return result(GateOutcome.PASSED, verdict.reason)
        return result(GateOutcome.FAILED, verdict.reason)
    return result(GateOutcome.FAILED, f"the {spec.kind} gate is not available in this build (rollout_gates missing)")
