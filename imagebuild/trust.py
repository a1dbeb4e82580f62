"""STAND-IN for the lead's trust.py (brief's interface), only until main has the real one.

The verify branch deletes this file before merging main; nothing else should depend on it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import yaml

from .source import InputError


class Mode(str, Enum):
    ENFORCE = "enforce"
    WARN = "warn"


class FailurePolicy(str, Enum):
    FAIL = "fail"
    IGNORE = "ignore"


@dataclass(frozen=True)
class PublicKey:
    name: str
    pem: str
    source: str


@dataclass(frozen=True)
class Requirements:
    attestations: tuple[str, ...]
    smoke_passed: bool
    gate_passed: bool
    block_severity: str | None


@dataclass(frozen=True)
class WebhookSettings:
    namespace: str
    name: str
    image: str
    port: int


@dataclass(frozen=True)
class TrustConfig:
    path: Path
    mode: Mode
    keys: tuple[PublicKey, ...]
    images: tuple[str, ...]
    require: Requirements
    failure_policy: FailurePolicy
    cache_ttl_seconds: int
    webhook: WebhookSettings

    def covers(self, repository: str) -> bool:
        for glob in self.images:
            pattern = re.escape(glob).replace(r"\*\*", "\0").replace(r"\*", "[^/]*").replace("\0", ".*")
            if re.fullmatch(pattern, repository):
                return True
        return False


def _key(entry: dict, base: Path) -> PublicKey:
    if "pem" in entry:
        return PublicKey(entry["name"], entry["pem"], "inline")
    path = Path(entry["path"])
    path = path if path.is_absolute() else base / path
    return PublicKey(entry.get("name", path.stem), path.read_text(), str(path))


def load_trust_config(path: Path) -> TrustConfig:
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise InputError(str(path), None, "", str(exc)) from None
    require = data.get("require") or {}
    return TrustConfig(
        Path(path), Mode(data.get("mode", "enforce")),
        tuple(_key(k, Path(path).parent) for k in data["keys"]), tuple(data["images"]),
        Requirements(tuple(require.get("attestations") or ()), bool(require.get("smoke_passed")),
                     bool(require.get("gate_passed")), require.get("block_severity")),
        FailurePolicy(data.get("failure_policy", "fail")), int(data.get("cache_ttl_seconds", 60)),
        WebhookSettings("imagebuild-system", "imagebuild-admission", "REF", 8443))


def trust_config_for_keys(keys: list[Path], images: list[str] | None = None) -> TrustConfig:
    return TrustConfig(
        Path("<--key>"), Mode.ENFORCE, tuple(_key({"path": str(k), "name": Path(k).stem}, Path.cwd()) for k in keys),
        tuple(images or ["**"]), Requirements((), False, False, None), FailurePolicy.FAIL, 60,
        WebhookSettings("imagebuild-system", "imagebuild-admission", "REF", 8443))
