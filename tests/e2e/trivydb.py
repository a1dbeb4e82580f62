"""The fixture vulnerability DB: built with Trivy's own Go package from tests/fixtures/trivydb.

These machines cannot download Trivy's DB, so the e2e tests and the scan benchmark build a
small one: `go build` (modules through the Go module proxy, pinned by go.mod and go.sum;
binary and build cache in tests/fixtures/trivydb/_build/, which git ignores), then the
program writes DIR/db/trivy.db and DIR/db/metadata.json, so that `trivy --cache-dir DIR
--skip-db-update --offline-scan` reads it.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[1] / "fixtures" / "trivydb"
BUILD = SOURCE / "_build"

# Advisories the program writes (see main.go for where each fixed version comes from).
# Fixed in bookworm-security: an up-to-date image carries the fix, so no finding.
EXPAT = {"id": "CVE-2024-28757", "package": "libexpat1", "source": "expat", "fixed": "2.5.0-1+deb12u4",
         "severity": "HIGH"}
PAM = {"id": "CVE-2024-22365", "package": "libpam0g", "source": "pam", "fixed": "1.5.2-6+deb12u3",
       "severity": "MEDIUM"}
DEBIAN_FIXED = (EXPAT, PAM)
# Not fixed in bookworm: every image shows them, with no fixed version.
ZLIB = {"id": "CVE-2023-45853", "package": "zlib1g", "source": "zlib", "fixed": "", "severity": "CRITICAL",
        "status": "will_not_fix"}
PERL = {"id": "CVE-2023-31486", "packages": ("libperl5.36", "perl", "perl-base", "perl-modules-5.36"),
        "source": "perl", "fixed": "", "severity": "HIGH", "status": "affected"}
# PyPI: the pip that `python3 -m venv` puts into the image (Debian's bundled 23.0.1 wheel).
PIP = {"id": "CVE-2023-5752", "package": "pip", "fixed": "23.3", "severity": "MEDIUM"}


class FixtureError(Exception):
    """The fixture DB could not be built; the message says why and what to do."""


def find_go() -> str:
    for candidate in (os.environ.get("GO"), shutil.which("go"), "/usr/local/go/bin/go"):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
    raise FixtureError("Go is not installed (looked for $GO, go on PATH and /usr/local/go/bin/go): the e2e tests "
                       "build their Trivy vulnerability DB with Go (tests/fixtures/trivydb). Install Go >= 1.24 at "
                       "/usr/local/go, as scripts/bootstrap.sh expects.")


def build_program() -> Path:
    """go build the fixture program (incremental after the first time)."""
    go = find_go()
    BUILD.mkdir(exist_ok=True)
    binary = BUILD / "trivydb"
    # GOTOOLCHAIN=local: never download another Go; -mod=readonly: go.sum must already pin everything;
    # -buildvcs=false: no git stamping (a CI clone may be shallow or owned by another user).
    env = {**os.environ, "GOCACHE": str(BUILD / "gocache"), "GOTOOLCHAIN": "local",
           "GOFLAGS": "-mod=readonly -buildvcs=false"}
    # Two pytest-xdist workers may want it at once: one builds, the other waits and finds it built.
    with open(BUILD / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        proc = subprocess.run([go, "build", "-trimpath", "-o", str(binary), "."], cwd=SOURCE, env=env,
                              capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0:
        raise FixtureError(f"go build in {SOURCE} failed (the Go module proxy must be reachable the first time):\n"
                           f"{proc.stderr[-3000:]}")
    return binary


def build_fixture_db(cache_dir: Path, extra: list[dict] | None = None) -> Path:
    """Write the fixture DB into CACHE_DIR/db; returns CACHE_DIR.

    `extra`: advisories to add, as published after a release (main.go's extraAdvisory), e.g.
    {"ecosystem": "pypi", "id": ..., "package": ..., "vulnerable": ["<9"], "patched": ["9"],
    "severity": "CRITICAL", "title": ..., "published": "2026-11-30T00:00:00Z"}.
    """
    import json

    binary = build_program()
    args = [str(binary), "-out", str(cache_dir / "db")]
    if extra:
        cache_dir.mkdir(parents=True, exist_ok=True)
        extra_file = cache_dir / "extra-advisories.json"
        extra_file.write_text(json.dumps(extra))
        args += ["-extra", str(extra_file)]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise FixtureError(f"{binary} failed: {proc.stderr[-2000:]}")
    for name in ("trivy.db", "metadata.json"):
        if not (cache_dir / "db" / name).is_file():
            raise FixtureError(f"{binary} wrote no {name} into {cache_dir / 'db'}")
    return cache_dir


def push_db_artifact(cache_dir: Path, registry: str, repository: str, tag: str = "2") -> str:
    """Publish CACHE_DIR/db as Trivy publishes its DB (an OCI artifact holding db.tar.gz), to act
    as the organisation's DB mirror that `imagebuild scan --db-repository` names. Returns the reference."""
    import hashlib
    import io
    import json
    import tarfile

    import httpx

    archive = io.BytesIO()
    with tarfile.open(fileobj=archive, mode="w:gz") as tar:
        for name in ("trivy.db", "metadata.json"):
            tar.add(cache_dir / "db" / name, arcname=name)
    layer, config = archive.getvalue(), b"{}"
    with httpx.Client(base_url=f"http://{registry}", timeout=60) as client:
        def upload(blob: bytes) -> str:
            digest = "sha256:" + hashlib.sha256(blob).hexdigest()
            start = client.post(f"/v2/{repository}/blobs/uploads/")
            start.raise_for_status()
            location = start.headers["location"]
            client.put(f"{location}{'&' if '?' in location else '?'}digest={digest}", content=blob,
                       headers={"Content-Type": "application/octet-stream"}).raise_for_status()
            return digest

        manifest = {
            "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.aquasec.trivy.config.v1+json", "digest": upload(config),
                       "size": len(config)},
            "layers": [{"mediaType": "application/vnd.aquasec.trivy.db.layer.v1.tar+gzip", "digest": upload(layer),
                        "size": len(layer), "annotations": {"org.opencontainers.image.title": "db.tar.gz"}}],
        }
        client.put(f"/v2/{repository}/manifests/{tag}", content=json.dumps(manifest),
                   headers={"Content-Type": manifest["mediaType"]}).raise_for_status()
    return f"{registry}/{repository}:{tag}"
