"""Stand-in for the gate and region classes of imagebuild/release.py (owned by the rollout work).

Exactly the shapes the issue-12 brief fixes, so rollout_gates.py can be written and tested before
release.py exists. Delete this file once release.py is on the branch (rollout_gates imports from
there first).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CredentialRef:
    docker_config: str | None = None
    env: str | None = None


@dataclass(frozen=True)
class Region:
    name: str
    registry: str
    repository: str
    harbor_project: str | None = None
    credentials: CredentialRef | None = None


@dataclass(frozen=True)
class GateSpec:
    pass


@dataclass(frozen=True)
class SoakGate(GateSpec):
    seconds: float


@dataclass(frozen=True)
class SignatureGate(GateSpec):
    pass


@dataclass(frozen=True)
class SmokeGate(GateSpec):
    tier: str = "abi"


@dataclass(frozen=True)
class PrometheusGate(GateSpec):
    url: str
    query: str
    max: float | None = None
    min: float | None = None
    for_seconds: float = 0.0


@dataclass(frozen=True)
class HttpGate(GateSpec):
    url: str
    expect_status: int = 200
    timeout_s: float = 5.0


@dataclass(frozen=True)
class ApprovalGate(GateSpec):
    pass
