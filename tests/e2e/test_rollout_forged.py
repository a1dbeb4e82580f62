"""Someone who can push to the state repository forges what the reconciler reads there (README, threat
model): a record whose `previous` is an unsigned or quarantined digest, whose steps name another image's
`sha256-<hex>.sig` tag or a region, repository or channel release.yaml does not name, and a state blob
served with content that does not match its digest. Each is tried against the real registries, through
the CLI, and refused: no tag outside release.yaml is touched, no channel tag points at a digest that
does not verify, and the command exits non-zero saying why. The genuine record then still works.
"""
from __future__ import annotations

import copy
import hashlib
import json
import subprocess
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from imagebuild.config.release_file import load_release
from imagebuild.rollout import quarantine
from imagebuild.rollout.reconciler import record_tag
from imagebuild.rollout.state import RECORD_TYPE, StateStore, open_store

from .conftest import REGIONS, STAGING, require_registry
from .oci_servers import FlakyProxy
from .test_rollout import CANARY_THEN_REST, Setup, make_image, rollout_id_of
from .tools import bootstrap_key, crane, tool

CANARY_ONLY = """\
- name: canary
  regions: [eu-west]
  gates: {signature: true}
"""


@pytest.fixture(scope="module", autouse=True)
def registries_up():
    for host in [STAGING, *REGIONS.values()]:
        require_registry(host)
    bootstrap_key()


def state(setup: Setup) -> StateStore:
    return open_store(load_release(setup.release))


def raw_record(setup: Setup, rollout_id: str) -> dict:
    """The record as stored, unchecked: what a forger starts from."""
    store = state(setup)
    try:
        record = store.read(record_tag(rollout_id))
    finally:
        store.registry.close()
    assert record is not None
    return record


def forge(setup: Setup, rollout_id: str, record: dict) -> None:
    """Push `record` as the rollout's record: a plain push to the state repository, all a forger needs."""
    store = state(setup)
    try:
        store.write(record_tag(rollout_id), record, RECORD_TYPE)
    finally:
        store.registry.close()


def _listed(repository: str) -> list[str]:
    """`crane ls`: the repository's tags; none when the registry does not know the repository yet."""
    run = subprocess.run([tool("crane"), "ls", repository, "--insecure"], capture_output=True, text=True, timeout=60)
    if run.returncode != 0 and "NAME_UNKNOWN" in run.stderr:
        return []
    assert run.returncode == 0, run.stderr
    return run.stdout.split()


def tags_of(setup: Setup) -> dict[str, dict[str, str]]:
    """Every tag of the test's repository in every region and the digest it names, read with crane."""
    found: dict[str, dict[str, str]] = {}
    for region, host in setup.regions.items():
        repository = f"{host}/{setup.repository}"
        found[region] = {tag: crane("digest", f"{repository}:{tag}").strip() for tag in _listed(repository)}
    return found


def completed_canary(tmp_path: Path) -> tuple[Setup, str, str, str, str]:
    """A canary-only rollout of a signed image over an earlier `stable` in eu-west, completed:
    (setup, region host, the digest before, the rolled-out digest, the rollout id)."""
    setup = Setup(tmp_path)
    setup.write(CANARY_ONLY)
    host = REGIONS["eu-west"]
    before = make_image(tmp_path, host, setup.repository, "stable")
    image = setup.source()
    digest = image.split("@")[1]
    run = setup.start(image)
    assert run.returncode == 0, run.stderr
    return setup, host, before, digest, rollout_id_of(run)


# --- rollback restoring a forged previous digest ----------------------------------------------------------


def test_rollback_never_restores_a_forged_previous_digest_that_does_not_verify_or_is_quarantined(tmp_path):
    setup, host, before, digest, rollout_id = completed_canary(tmp_path)
    assert setup.tag("eu-west", "stable") == digest
    genuine = raw_record(setup, rollout_id)
    assert genuine["previous"] == {"eu-west/stable": before}

    # An unsigned image the forger pushed (to any repository it can reach; here the region's own).
    unsigned = make_image(tmp_path, host, setup.repository, "unsigned", sign=False)
    forged = copy.deepcopy(genuine)
    forged["previous"]["eu-west/stable"] = unsigned
    forge(setup, rollout_id, forged)
    refused = setup.cli("rollback", rollout_id)
    assert refused.returncode == 1, refused.stderr
    assert f"will not point stable back: {host}/{setup.repository}@{unsigned} does not verify" in refused.stderr
    assert crane("digest", f"{host}/{setup.repository}:stable").strip() == digest  # not moved
    assert setup.record(rollout_id)["status"] == "halted"

    # A signed image, but quarantined (nightly rescan found it failing the gate): never tagged either.
    bad = make_image(tmp_path, host, setup.repository, "old-release")
    store = state(setup)
    try:
        quarantine.mark(store, bad, "CVE-2026-0001 in libfoo")
    finally:
        store.registry.close()
    forged = copy.deepcopy(genuine)
    forged["previous"]["eu-west/stable"] = bad
    forge(setup, rollout_id, forged)
    refused = setup.cli("rollback", rollout_id)
    assert refused.returncode == 1, refused.stderr
    assert f"will not point stable back: {bad} is quarantined" in refused.stderr
    assert "CVE-2026-0001 in libfoo" in refused.stderr
    assert crane("digest", f"{host}/{setup.repository}:stable").strip() == digest

    # The genuine record: rollback restores the signed previous digest.
    forge(setup, rollout_id, genuine)
    back = setup.cli("rollback", rollout_id)
    assert back.returncode == 0, back.stderr
    assert crane("digest", f"{host}/{setup.repository}:stable").strip() == before
    assert setup.serving_unsigned() == []


# --- resume acting on forged steps --------------------------------------------------------------------


def _sig_tag(digest: str) -> str:
    return "sha256-" + digest.split(":", 1)[1] + ".sig"


def _move_steps(record: dict) -> Iterator[dict]:
    return (step for step in record["steps"] if step["kind"] == "move-tag")


def test_resume_refuses_a_record_that_names_tags_regions_or_repositories_release_yaml_does_not(tmp_path):
    setup = Setup(tmp_path)
    setup.write(CANARY_THEN_REST)
    eu = REGIONS["eu-west"]
    other = make_image(tmp_path, eu, setup.repository, "other-image")  # signed: its .sig tag is the target
    image = setup.source()
    digest = image.split("@")[1]
    killed = setup.start(image, kill_at="recorded:0")  # the canary copy is done
    assert killed.returncode < 0, killed.stderr
    rollout_id = rollout_id_of(killed)
    genuine = raw_record(setup, rollout_id)
    untouched = tags_of(setup)
    assert untouched["eu-west"][_sig_tag(other)] != digest

    def sig_tag_steps(record: dict) -> None:  # the attack: resume records, then moves, another image's .sig
        for step in record["steps"]:
            if step["tag"] is not None:
                step["tag"] = _sig_tag(other)

    def sig_tag_channel(record: dict) -> None:  # the same, the channels made to agree
        sig_tag_steps(record)
        record["channels"] = [_sig_tag(other)]

    def own_region(record: dict) -> None:
        next(_move_steps(record))["region"] = "eu-west-shadow"

    def own_repository(record: dict) -> None:
        next(_move_steps(record)).update(registry=REGIONS["ap-south"], repository=f"{setup.name}/victim")

    def own_tag(record: dict) -> None:
        next(_move_steps(record))["tag"] = "latest"

    forgeries = {
        sig_tag_steps: "release.yaml plans #2 record-previous canary/eu-west/stable",
        sig_tag_channel: f"channel '{_sig_tag(other)}' is not among the release's channels",
        own_region: "release.yaml plans #3 move-tag canary/eu-west/stable",
        own_repository: "step 3 carries ['registry', 'repository'], which a rollout step never records",
        own_tag: "release.yaml plans #3 move-tag canary/eu-west/stable",
    }
    for edit, reason in forgeries.items():
        forged = copy.deepcopy(genuine)
        edit(forged)
        forge(setup, rollout_id, forged)
        refused = setup.cli("resume", rollout_id)
        assert refused.returncode == 1, (edit.__name__, refused.stderr)
        assert f"error: rollout: rollout {rollout_id}: refusing its record" in refused.stderr, edit.__name__
        assert reason in refused.stderr and "nothing was changed" in refused.stderr, (edit.__name__, refused.stderr)
        assert tags_of(setup) == untouched, edit.__name__

    # A digest and source of the forger's choosing, consistent with each other: the source must verify
    # in staging again, as `start` demanded, so an unsigned one is copied nowhere.
    unsigned = setup.source("unsigned-candidate", sign=False)
    forged = copy.deepcopy(genuine)
    forged.update(source=unsigned, digest=unsigned.split("@")[1])
    forge(setup, rollout_id, forged)
    refused = setup.cli("resume", rollout_id)
    assert refused.returncode == 1 and f"refusing to roll out {unsigned}: it does not verify in staging" \
        in refused.stderr, refused.stderr
    assert tags_of(setup) == untouched
    assert not any(setup.has(region, unsigned.split("@")[1]) for region in REGIONS)

    # The genuine record resumes and completes; the other image's signature tag never moved.
    forge(setup, rollout_id, genuine)
    resumed = setup.cli("resume", rollout_id)
    assert resumed.returncode == 0, resumed.stderr
    assert {region: setup.tag(region, "stable") for region in REGIONS} == dict.fromkeys(REGIONS, digest)
    assert tags_of(setup)["eu-west"][_sig_tag(other)] == untouched["eu-west"][_sig_tag(other)]
    assert setup.serving_unsigned() == []


# --- a state blob that does not match its digest ------------------------------------------------------


class TamperingProxy(FlakyProxy):
    """In front of the staging registry: answers chosen GETs with bytes of its own, forwards the rest."""

    def __init__(self, upstream: str):
        super().__init__(upstream)
        self.answers: dict[str, tuple[bytes, dict[str, str]]] = {}  # path -> (body, headers)
        self.paths: list[str] = []

    def _handle(self, handler: BaseHTTPRequestHandler) -> None:
        path = urlsplit(handler.path).path
        self.paths.append(path)
        answer = self.answers.get(path)
        if answer is None or handler.command not in ("GET", "HEAD"):
            super()._handle(handler)
            return
        body, headers = answer
        handler.send_response(200)
        for key, value in {**headers, "Content-Length": str(len(body))}.items():
            handler.send_header(key, value)
        handler.end_headers()
        if handler.command == "GET":
            handler.wfile.write(body)


@pytest.fixture
def tampering_proxy():
    proxy = TamperingProxy(STAGING)
    yield proxy
    proxy.stop()


def test_a_state_blob_whose_content_does_not_match_its_digest_is_refused(tmp_path, tampering_proxy):
    setup, host, before, digest, rollout_id = completed_canary(tmp_path)
    unsigned = make_image(tmp_path, host, setup.repository, "unsigned", sign=False)

    # From now on the state repository is read through the proxy (the same repository behind it).
    setup.release.write_text(setup.release.read_text().replace(f"registry: '{STAGING}'", f"registry: "
                                                               f"'{tampering_proxy.host}'", 1))
    state_repository = f"{setup.name}/rollouts"
    manifest = json.loads(crane("manifest", f"{STAGING}/{state_repository}:{record_tag(rollout_id)}"))
    layer = manifest["layers"][0]
    genuine = json.loads(crane("blob", f"{STAGING}/{state_repository}@{layer['digest']}"))
    tampered = copy.deepcopy(genuine)
    tampered["previous"]["eu-west/stable"] = unsigned
    blob_path = f"/v2/{state_repository}/blobs/{layer['digest']}"
    headers = {"Content-Type": "application/octet-stream", "Docker-Content-Digest": layer["digest"]}
    body = json.dumps(tampered, sort_keys=True, separators=(",", ":")).encode()
    assert len(body) == layer["size"]  # one digest swapped for another: the same length, other bytes
    served = {
        "other bytes": (body, f"blob {layer['digest']} does not match its content"),
        "shorter": (body[:-9], f"blob {layer['digest']} does not match its content"),
        "longer": (body + b" " * 9, f"blob {layer['digest']} is longer than its descriptor's {layer['size']} bytes"),
    }
    for what, (content, message) in served.items():
        assert hashlib.sha256(content).hexdigest() != layer["digest"].split(":")[1]
        tampering_proxy.answers[blob_path] = (content, headers)
        for command in ("rollback", "status"):
            refused = setup.cli(command, rollout_id)
            assert refused.returncode == 1, (what, command, refused.stderr)
            assert message in refused.stderr, (what, command, refused.stderr)
            assert "Traceback" not in refused.stderr
        assert crane("digest", f"{host}/{setup.repository}:stable").strip() == digest

    # A manifest whose layer digest walks out of the repository: refused before it goes into a URL.
    walk = dict(manifest, layers=[dict(layer, digest="sha256:../../../imagebuild/debian/blobs/sha256:" + "0" * 64)])
    tampering_proxy.answers.clear()
    tampering_proxy.answers[f"/v2/{state_repository}/manifests/{record_tag(rollout_id)}"] = (
        json.dumps(walk).encode(), {"Content-Type": manifest["mediaType"]})
    tampering_proxy.paths.clear()
    refused = setup.cli("rollback", rollout_id)
    assert refused.returncode == 1 and "is not sha256:<64 hex>" in refused.stderr, refused.stderr
    assert not any("/blobs/" in path for path in tampering_proxy.paths), tampering_proxy.paths

    # Served faithfully again (through the same proxy): the genuine rollback restores the signed digest.
    tampering_proxy.answers.clear()
    back = setup.cli("rollback", rollout_id)
    assert back.returncode == 0, back.stderr
    assert crane("digest", f"{host}/{setup.repository}:stable").strip() == before


# --- a forged lease ---------------------------------------------------------------------------------


def test_a_lease_that_cannot_be_read_holds_the_channel_and_is_shown_escaped(tmp_path):
    from imagebuild.rollout.state import LEASE_TYPE, state_tag

    setup = Setup(tmp_path)
    setup.write(CANARY_ONLY)
    image = setup.source()
    store = state(setup)
    try:
        store.write(state_tag("lease", "stable"), {"rollout": "x\x1b[2J", "expires_at": "never"}, LEASE_TYPE)
        refused = setup.start(image)
        assert refused.returncode == 4, refused.stderr
        assert "channel 'stable' is being rolled out: an unreadable lease (expires_at never)" in refused.stderr
        assert "\x1b" not in refused.stderr and "Traceback" not in refused.stderr
        assert setup.tag("eu-west", "stable") is None
        store.delete(state_tag("lease", "stable"))  # deleted by hand, as the message says: the channel is free
    finally:
        store.registry.close()
    assert setup.start(image).returncode == 0
    assert setup.tag("eu-west", "stable") == image.split("@")[1]
