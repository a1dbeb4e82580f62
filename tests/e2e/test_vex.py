"""Exceptions as signed VEX, end to end: a small image built on the local Debian base behind a channel tag,
signed with real cosign, its policy exception attested as OpenVEX (`imagebuild vex attest`); then a DB that
learns of a new advisory against its zlib, and `imagebuild rescan` with real Trivy: the signed statement
covers the advisory until its last day, and the day after the image is quarantined.

The rescan's own policy has no exception at all: only the signed VEX can let the advisory through.
"""
from __future__ import annotations

import datetime as dt
import json
import textwrap
from pathlib import Path

import pytest

from imagebuild.checks.scan import ScanOptions, Trivy, scan_image
from imagebuild.config.trust import load_trust_config
from imagebuild.trust.verify import Verifier
from imagebuild.trust.vex_attest import signed_for_scan

from .conftest import REGIONS, STAGING, imagebuild, require_registry, unique
from .tools import KEYS, Image, push_tiny_image
from .trivydb import FixtureError, build_fixture_db

pytestmark = pytest.mark.e2e

BASE = f"{STAGING}/imagebuild/debian:12"
NEWS = {"ecosystem": "debian12", "id": "CVE-2099-42001", "package": "zlib", "fixed": "1:99.0-1",
        "severity": "CRITICAL", "title": "zlib: an advisory published after the release",
        "description": "A test advisory: every zlib before 99.0 is affected.", "published": "2026-11-30T00:00:00Z"}
LAST_DAY = dt.date(2027, 1, 31)


@pytest.fixture(scope="module")
def released(cosign_cli, our_key, tmp_path_factory) -> dict:
    """The image behind the `cpu` channel tag of one region, signed, with its VEX attested; a DB knowing NEWS."""
    region = REGIONS["eu-west"]
    for host in (STAGING, region):
        require_registry(host)
    folder = tmp_path_factory.mktemp("vex")
    name = unique("vex")
    repository = f"{region}/{name}/paddle"
    image = Image(repository, "cpu", push_tiny_image(folder / "image", f"{repository}:cpu", base=BASE))
    cosign_cli.sign(image, our_key)
    try:
        cache = build_fixture_db(folder / "cache", extra=[NEWS])
    except FixtureError as exc:
        pytest.fail(str(exc), pytrace=False)
    # The image's SBOM, as `imagebuild scan` writes it (the purls an exception's packages name).
    scan_image(Trivy.find(), image.by_digest, "cpu", ScanOptions(workdir=folder, dockerfiles=folder, cache_dir=cache,
                                                                 offline=True), folder / "scan")
    (folder / "exceptions.yaml").write_text(textwrap.dedent(f"""\
        schema: 1
        exceptions:
          - id: {NEWS['id']}
            packages: [zlib]
            owner: ml-platform-security@example.com
            reason: The images never inflate untrusted data with zlib.
            expires: {LAST_DAY.isoformat()}
        """))
    (folder / "policy.yaml").write_text("schema: 1\nseverity: HIGH\nignore_unfixed: true\nexceptions: []\n")
    (folder / "trust.yaml").write_text(textwrap.dedent(f"""\
        schema: 1
        mode: enforce
        keys: [{{name: imagebuild-local, path: {KEYS / 'cosign.pub'}}}]
        images: ["127.0.0.1:*/**"]
        require: {{attestations: [], vex_current: true}}
        cache_ttl_seconds: 0
        """))
    (folder / "release.yaml").write_text(
        f"schema: 1\ntrust: trust.yaml\nstate: {{registry: '{STAGING}', repository: {name}/rollouts}}\n"
        f"regions:\n  - {{name: eu-west, registry: '{region}', repository: {name}/paddle}}\n"
        "channels: [cpu]\nwaves:\n  - {name: all, regions: [eu-west], gates: {soak: 1s}}\n")
    attested = imagebuild("vex", "attest", image.by_digest, "--variant", "cpu", "--policy",
                          str(folder / "exceptions.yaml"), "--sbom", str(folder / "scan" / "sbom.cdx.json"),
                          "--key", str(our_key.private), "--out", str(folder / "vex"), "--today", "2026-12-04",
                          "--format", "json", env={"COSIGN_PASSWORD": our_key.password}, timeout=300)
    assert attested.returncode == 0, attested.stderr[-3000:]
    assert attested.json()["statements"] == [NEWS["id"]]
    return {"folder": folder, "image": image, "cache": cache}


def rescan(released: dict, today: dt.date):
    folder = released["folder"]
    return imagebuild("rescan", "--release", str(folder / "release.yaml"), "--policy", str(folder / "policy.yaml"),
                      "--offline", "--cache-dir", str(released["cache"]), "--out", str(folder / "rescan"),
                      "--state-dir", str(folder / "state"), "--today", today.isoformat(), "--format", "json",
                      timeout=600)


def test_the_signed_statement_is_what_cosign_verifies_with_its_subcomponent_and_last_day(released, cosign_cli,
                                                                                         our_key):
    (statement,) = cosign_cli.statements(released["image"].by_digest, our_key.public, "https://openvex.dev/ns/v0.2.0")
    (vex,) = statement["predicate"]["statements"]
    hex_digest = released["image"].digest.split(":", 1)[1]
    assert vex["vulnerability"]["name"] == NEWS["id"] and vex["status"] == "not_affected"
    assert vex["products"] == [{"@id": f"pkg:oci/paddle@sha256%3A{hex_digest}",
                                "subcomponents": [{"@id": "pkg:deb/debian/zlib1g"}]}]
    assert vex["imagebuild:expires"] == LAST_DAY.isoformat()
    # The trust file requires a current VEX document (require.vex_current): this one is, today.
    verified = imagebuild("verify", released["image"].by_digest, "--trust", str(released["folder"] / "trust.yaml"))
    assert verified.returncode == 0, (verified.stdout, verified.stderr)


def test_a_new_advisory_the_signed_vex_covers_does_not_quarantine_until_the_statement_expires(released):
    digest = released["image"].digest
    covered = rescan(released, LAST_DAY)
    assert covered.returncode == 0, (covered.stdout[-2000:], covered.stderr[-2000:])
    (image,) = covered.json()["images"]
    assert image["status"] == "passed" and image["blocking"] == []
    assert image["vex"]["statements"] == [NEWS["id"]] and image["vex"]["problem"] is None
    handed = json.loads(Path(image["vex"]["file"]).read_text())
    assert [s["vulnerability"]["name"] for s in handed["statements"]] == [NEWS["id"]]

    shown = imagebuild("vex", "show", released["image"].by_digest, "--trust", str(released["folder"] / "trust.yaml"),
                       "--today", LAST_DAY.isoformat(), "--format", "json")
    assert shown.returncode == 0 and shown.json()["statements"] == [NEWS["id"]], shown.stderr

    expired = rescan(released, LAST_DAY + dt.timedelta(days=1))
    assert expired.returncode == 1, (expired.stdout[-2000:], expired.stderr[-2000:])
    (image,) = expired.json()["images"]
    assert image["status"] == "quarantined" and [b["id"] for b in image["blocking"]] == [NEWS["id"]]
    assert image["vex"]["statements"] == [] and image["vex"]["expired"] == [f"{NEWS['id']} (expired 2027-01-31)"]
    assert expired.json()["quarantined"] == [digest]


def test_an_unsigned_image_has_no_vex_that_counts(released, tmp_path):
    """Nothing of an image whose signature does not verify reaches Trivy: the policy alone judges it."""
    repository = f"{REGIONS['eu-west']}/{unique('vex-unsigned')}/paddle"
    other = push_tiny_image(tmp_path, f"{repository}:cpu", base=BASE)
    with Verifier(load_trust_config(released["folder"] / "trust.yaml"), cache_ttl_seconds=0) as verifier:
        found = signed_for_scan(verifier, f"{repository}@{other}", tmp_path / "out", LAST_DAY)
    assert found.path is None and found.problem is not None and "not verified" in found.problem


def test_a_signed_but_malformed_document_counts_for_nothing(released, cosign_cli, our_key, tmp_path):
    """Signed by our key yet not a document of ours: refused field by field, in one line, and no VEX is used."""
    repository = f"{REGIONS['eu-west']}/{unique('vex-hostile')}/paddle"
    image = Image(repository, "cpu", push_tiny_image(tmp_path, f"{repository}:cpu", base=BASE))
    cosign_cli.sign(image, our_key)
    hostile = {"@context": "https://openvex.dev/ns/v0.2.0", "@id": "x", "author": "\x1b[31mme", "timestamp": "t",
               "version": 1, "statements": [{"vulnerability": {"name": NEWS["id"]}, "status": "not_affected",
                                             "justification": "component_not_present", "imagebuild:expires": "2099-01-01",
                                             "products": [{"@id": "pkg:oci/paddle"}]}]}
    cosign_cli.attest(image, our_key, "https://openvex.dev/ns/v0.2.0", hostile, tmp_path)
    with Verifier(load_trust_config(released["folder"] / "trust.yaml"), cache_ttl_seconds=0) as verifier:
        found = signed_for_scan(verifier, image.by_digest, tmp_path / "out", LAST_DAY)
    assert found.path is None and "\n" not in (found.problem or "")
    assert "statements[0].products[0].@id: not an image by digest" in (found.problem or "")
