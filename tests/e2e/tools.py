"""The external tools as the e2e tests drive them, independently of imagebuild: cosign, crane, skopeo.

One place for what several test modules need: finding the pinned binaries, pushing a tiny image of
unique content, and cosign run offline (no transparency log, plain-http loopback registries) with
bootstrap's key pair or one made for a test. The fixtures built on these live in conftest.py.
"""
from __future__ import annotations

import base64
import json
import os
import subprocess
import tarfile
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

KEYS = Path("/var/lib/imagebuild/keys")  # bootstrap's cosign key pair, outside the repository
# cosign sign/attest, and cosign verify/verify-attestation, against the local registries without Rekor.
COSIGN_SIGN_OFFLINE = ["--tlog-upload=false", "--allow-http-registry", "--allow-insecure-registry", "--yes"]
COSIGN_VERIFY_OFFLINE = ["--insecure-ignore-tlog", "--allow-http-registry", "--allow-insecure-registry"]
# The predicate types of the four attestations `imagebuild sign` attaches, spelled out here rather than
# read from imagebuild, so that a wrong constant there cannot make the tests agree with it.
TYPES = {
    "sbom": "https://cyclonedx.org/bom",
    "vuln": "https://cosign.sigstore.dev/attestation/vuln/v1",
    "smoke": "https://imagebuild.dev/attestations/smoke/v1",
    "gate": "https://imagebuild.dev/attestations/gate/v1",
}
COSIGN_TYPE_FLAG = {"sbom": "cyclonedx", "vuln": "vuln", "smoke": TYPES["smoke"], "gate": TYPES["gate"]}


def tool(name: str) -> str:
    """The pinned binary bootstrap installs (crane, cosign, ...); the test fails, saying how to get it, without it."""
    from imagebuild.core.runner import TOOLS_DIR

    path = TOOLS_DIR / name
    if not os.access(path, os.X_OK):
        pytest.fail(f"{path} is missing; run scripts/bootstrap.sh", pytrace=False)
    return str(path)


def crane(*args: str, timeout: float = 300) -> str:
    """`crane ARGS --insecure` (plain http to the loopback registries), which must succeed; its stdout."""
    run = subprocess.run([tool("crane"), *args, "--insecure"], capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, f"crane {' '.join(args)}: {run.stderr[-2000:]}"
    return run.stdout


def push_tiny_image(directory: Path, ref: str, base: str | None = None, size: int = 64) -> str:
    """A one-layer image holding `size` random bytes (so a digest never seen before), pushed by crane; its digest."""
    directory.mkdir(parents=True, exist_ok=True)
    payload = directory / f"payload-{uuid.uuid4().hex[:8]}"
    payload.write_bytes(os.urandom(size))
    layer = directory / f"{payload.name}.tar"
    with tarfile.open(layer, "w") as archive:
        archive.add(payload, arcname=payload.name)
    crane("append", "-f", str(layer), "-t", ref, *(["-b", base] if base else []))
    return crane("digest", ref).strip()


def skopeo_digest(skopeo: str, ref: str, creds: str | None = None, ca_dir: Path | None = None,
                  env: dict[str, str] | None = None) -> str:
    """The manifest digest as `skopeo inspect` reads it (plain http unless a CA folder is given)."""
    argv = [skopeo, "inspect", "--format", "{{.Digest}}"]
    argv += ["--cert-dir", str(ca_dir)] if ca_dir else ["--tls-verify=false"]
    argv += ["--creds", creds] if creds else []
    run = subprocess.run([*argv, f"docker://{ref}"], capture_output=True, text=True, timeout=120,
                         env={**os.environ, **(env or {})})
    if run.returncode != 0:
        pytest.fail(f"skopeo inspect {ref} failed ({run.returncode}): {run.stderr[-2000:]}", pytrace=False)
    return run.stdout.strip()


@dataclass(frozen=True)
class KeyPair:
    private: Path
    public: Path
    password: str


def bootstrap_key() -> KeyPair:
    """The key pair (and its password) scripts/bootstrap.sh generates outside the repository."""
    paths = (KEYS / "cosign.key", KEYS / "cosign.pub", KEYS / "cosign.password")
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        pytest.fail(f"cosign key pair missing ({', '.join(missing)}); run scripts/bootstrap.sh", pytrace=False)
    return KeyPair(paths[0], paths[1], paths[2].read_text().strip())


@dataclass(frozen=True)
class Image:
    repository: str  # registry/repository
    tag: str
    digest: str

    @property
    def by_tag(self) -> str:
        return f"{self.repository}:{self.tag}"

    @property
    def by_digest(self) -> str:
        return f"{self.repository}@{self.digest}"

    def signature_tag(self, suffix: str = ".sig") -> str:
        return self.digest.replace(":", "-") + suffix


def _ref(image: Image | str) -> str:
    return image.by_digest if isinstance(image, Image) else image


def _cosign_type(kind: str) -> str:
    """`--type` for one of the four kinds (sbom, vuln, smoke, gate); any other value is passed as it is."""
    return COSIGN_TYPE_FLAG.get(kind, kind)


class Cosign:
    """The real cosign, offline: no transparency log, plain-http loopback registries."""

    def __init__(self, path: str) -> None:
        self.path = path

    def run(self, *args: str, password: str = "", env: dict[str, str] | None = None,
            timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run([self.path, *args], env={**os.environ, **(env or {}), "COSIGN_PASSWORD": password},
                              capture_output=True, text=True, timeout=timeout)

    def sign(self, image: Image | str, key: KeyPair) -> None:
        """Signs the image (by digest, for an Image) with the key; a failure fails the test."""
        run = self.run("sign", "--key", str(key.private), *COSIGN_SIGN_OFFLINE, _ref(image), password=key.password)
        assert run.returncode == 0, f"cosign sign {_ref(image)}: {run.stderr[-2000:]}"

    def attest(self, image: Image | str, key: KeyPair, kind: str, predicate: dict, directory: Path,
               *flags: str) -> None:
        """Attaches `predicate` as an attestation of `kind` (a kind name, or cosign's --type value)."""
        path = directory / f"predicate-{uuid.uuid4().hex[:8]}.json"
        path.write_text(json.dumps(predicate))
        run = self.run("attest", "--key", str(key.private), *COSIGN_SIGN_OFFLINE, *flags, "--type", _cosign_type(kind),
                       "--predicate", str(path), _ref(image), password=key.password)
        assert run.returncode == 0, f"cosign attest --type {_cosign_type(kind)} {_ref(image)}: {run.stderr[-2000:]}"

    def admits(self, ref: str, public: Path) -> bool:
        return self.run("verify", "--key", str(public), *COSIGN_VERIFY_OFFLINE, ref).returncode == 0

    def admits_attestation(self, ref: str, public: Path, kind: str, rego: Path | None = None) -> bool:
        policy = ["--policy", str(rego)] if rego else []
        run = self.run("verify-attestation", "--key", str(public), *COSIGN_VERIFY_OFFLINE,
                       "--type", _cosign_type(kind), *policy, ref)
        return run.returncode == 0

    def verified(self, ref: str, public: Path, env: dict[str, str] | None = None) -> list[dict]:
        """The signature claims `cosign verify` accepts, decoded; it must accept."""
        run = self.run("verify", "--key", str(public), *COSIGN_VERIFY_OFFLINE, ref, env=env)
        assert run.returncode == 0, f"cosign verify {ref}: {run.stderr[-2000:]}"
        return json.loads(run.stdout)

    def statements(self, ref: str, public: Path, kind: str) -> list[dict]:
        """The in-toto statements `cosign verify-attestation --type` accepts, decoded; it must accept."""
        run = self.run("verify-attestation", "--key", str(public), *COSIGN_VERIFY_OFFLINE,
                       "--type", _cosign_type(kind), ref)
        assert run.returncode == 0, f"cosign verify-attestation --type {_cosign_type(kind)} {ref}: {run.stderr[-2000:]}"
        return [json.loads(base64.b64decode(json.loads(line)["payload"])) for line in run.stdout.splitlines() if line]

    def generate_key_pair(self, directory: Path, password: str = "") -> KeyPair:
        """A new key pair, directory/other.key and other.pub (named "other" in trust configs)."""
        run = subprocess.run([self.path, "generate-key-pair", "--output-key-prefix", str(directory / "other")],
                             cwd=directory, env={**os.environ, "COSIGN_PASSWORD": password}, capture_output=True,
                             text=True, timeout=60)
        assert run.returncode == 0, run.stderr
        return KeyPair(directory / "other.key", directory / "other.pub", password)
