"""What `imagebuild push` and `promote` will do, decided without touching a registry (pure).

The effects (push.py) ask the registries what is there; everything they then decide goes
through here: where a variant goes, which release tags are written, kept or refused (release
tags are immutable), whether the audit in the target passed, and who moved a tag and why.
"""
from __future__ import annotations

import datetime as dt
import getpass
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from imagebuild.core.source import InputError
from imagebuild.oci import reference

# The environment that says who runs a job in CI; recorded with every forced tag move.
CI_IDENTITY_ENV = ("GITHUB_ACTOR", "GITHUB_TRIGGERING_ACTOR", "GITHUB_REPOSITORY", "GITHUB_WORKFLOW",
                   "GITHUB_RUN_ID", "GITHUB_RUN_ATTEMPT", "GITHUB_SHA", "GITLAB_USER_LOGIN", "CI_PIPELINE_ID",
                   "CI_JOB_ID", "BUILDKITE_BUILD_CREATOR", "BUILDKITE_BUILD_ID")


_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")


# --- where images go ------------------------------------------------------------------------------


def split_repository(text: str) -> tuple[str, str]:
    """`host[:port]/path` -> (API host, path), in the one reference grammar (imagebuild.oci.reference:
    the host normalised); ValueError when there is no registry host or no path, or a tag or digest."""
    try:
        parts = reference.split(text)
    except reference.RepositoryError:
        raise ValueError(f"'{text}': a repository path is lowercase segments separated by single slashes") from None
    except reference.ReferenceError as exc:
        raise ValueError(f"'{text}': {exc}") from None
    if parts.host is None:
        raise ValueError(f"'{text}' is not REGISTRY/REPOSITORY (e.g. harbor.example.com/paddle)")
    if parts.tag is not None or parts.digest is not None:
        raise ValueError(f"'{text}' names a tag or digest; give a repository")
    ref = reference.parse(text)
    return ref.registry, ref.repository


def target_repository(to: str, source_repository: str) -> str:
    """Where a variant goes: `--to` (REGISTRY/PROJECT) plus the image's name, the source's last path segment.

    127.0.0.1:5000/imagebuild-example/paddle pushed --to harbor.example.com/release lands in
    harbor.example.com/release/paddle: the project stays one Harbor project whatever the
    staging layout, and every variant of one image shares one release repository.
    """
    to = to.rstrip("/")
    split_repository(to)
    name = source_repository.rstrip("/").rsplit("/", 1)[-1]
    return f"{to}/{name}"


# --- release tags are immutable -------------------------------------------------------------------


class TagAction(str, Enum):
    WRITE = "write"  # absent in the target: written after the audit
    PRESENT = "present"  # already names this digest: nothing to do
    MOVE = "move"  # names another digest, and --force with a reason allows moving it (audit-logged)
    REFUSE = "refuse"  # names another digest: release tags are immutable

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class TagDecision:
    tag: str
    action: TagAction
    current: str | None  # the digest the target's tag names now; None when absent
    wanted: str

    def refusal(self, repository: str) -> str:
        return (f"{repository}:{self.tag} already names {self.current}, not {self.wanted}; release tags are "
                "immutable (move it with --force --reason TEXT)")


@dataclass(frozen=True)
class Force:
    """--force and --reason: moving a release tag needs both, and the reason is audit-logged."""

    enabled: bool = False
    reason: str | None = None

    @classmethod
    def parse(cls, force: bool, reason: str | None) -> Force:
        text = (reason or "").strip()
        if force and not text:
            raise InputError("--force", None, "", "needs --reason TEXT (it goes into the audit log)")
        if text and not force:
            raise InputError("--reason", None, "", "only goes with --force")
        if "\n" in text or len(text) > 1000:
            raise InputError("--reason", None, "", "one line of at most 1000 characters")
        return cls(force, text or None)


def decide_tags(wanted: str, current: Mapping[str, str | None], force: Force) -> list[TagDecision]:
    """Each release tag's fate: `current` maps the tag to the digest it names in the target (None: absent)."""
    decisions = []
    for tag, now in current.items():
        if now is None:
            action = TagAction.WRITE
        elif now == wanted:
            action = TagAction.PRESENT
        else:
            action = TagAction.MOVE if force.enabled else TagAction.REFUSE
        decisions.append(TagDecision(tag, action, now, wanted))
    return decisions


def refusals(decisions: Iterable[TagDecision], repository: str) -> list[str]:
    return [d.refusal(repository) for d in decisions if d.action is TagAction.REFUSE]


def check_tag(tag: str) -> str:
    """A tag as the distribution spec allows it; and never cosign's `sha256-...` (signature tags)."""
    if not _TAG.fullmatch(tag):
        raise ValueError(f"'{tag}' is not a valid tag ([A-Za-z0-9_][A-Za-z0-9._-]{{0,127}})")
    if tag.startswith("sha256-"):
        raise ValueError(f"'{tag}': sha256-* tags are cosign's signature and attestation tags")
    return tag


# --- the audit in the target ----------------------------------------------------------------------


@dataclass(frozen=True)
class AuditFacts:
    """What was found in the target after the copy (push.py gathers them)."""

    digest: str | None  # the target's manifest digest for the source digest; None when absent
    signature_verified: bool
    signature_reason: str  # the verifier's one line
    key: str | None  # the key that verified the signature
    attestations: tuple[str, ...]  # kinds that verified in the target (sbom, vuln, ...)


@dataclass(frozen=True)
class AuditResult:
    passed: bool
    digest: str | None
    key: str | None
    attestations: tuple[str, ...]
    problems: tuple[str, ...]
    audited_at: str

    def to_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "digest": self.digest, "key": self.key,
                "attestations": list(self.attestations), "problems": list(self.problems)}


def judge_audit(source_digest: str, expected_attestations: Iterable[str], facts: AuditFacts,
                now: dt.datetime) -> AuditResult:
    """Pass only when the target holds the very digest, its signature verifies, and every attestation
    the source had (and the trust config requires) verifies in the target too."""
    problems = []
    if facts.digest != source_digest:
        problems.append(f"the target holds {facts.digest or 'nothing'} for {source_digest}")
    if not facts.signature_verified:
        problems.append(f"signature: {facts.signature_reason}")
    missing = sorted(set(expected_attestations) - set(facts.attestations))
    if missing:
        problems.append(f"attestations missing or not verifying in the target: {', '.join(missing)}")
    return AuditResult(not problems, facts.digest, facts.key if facts.signature_verified else None,
                       tuple(sorted(facts.attestations)), tuple(problems), iso(now))


# --- who moved a tag ------------------------------------------------------------------------------


def iso(moment: dt.datetime) -> str:
    return moment.astimezone(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def actor(environ: Mapping[str, str]) -> dict[str, Any]:
    """Who runs this: the login name, and the CI job's identity when there is one (never a secret)."""
    user = environ.get("USER") or environ.get("LOGNAME")
    if not user:
        try:
            user = getpass.getuser()
        except (KeyError, OSError):
            user = "unknown"
    ci = {name: environ[name] for name in CI_IDENTITY_ENV if environ.get(name)}
    return {"user": user, "ci": ci}


def audit_entry(*, action: str, repository: str, decision: TagDecision, reason: str, who: Mapping[str, Any],
                source: str, now: dt.datetime) -> dict[str, Any]:
    """One line of WORKDIR/audit.jsonl: a release tag moved by --force."""
    return {"at": iso(now), "action": action, "who": dict(who), "repository": repository, "tag": decision.tag,
            "from_digest": decision.current, "to_digest": decision.wanted, "source": source, "reason": reason}
