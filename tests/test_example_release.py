"""examples/local/release.yaml, which scripts/example.sh rolls out with: the regions bootstrap starts,
canary first, and gates that need nobody (no Prometheus, no approval) in the demo."""
from __future__ import annotations

import re
from pathlib import Path

from imagebuild.config.release_file import ApprovalGate, PrometheusGate, SignatureGate, SoakGate, load_release
from imagebuild.config.trust import load_trust_config

from .conftest import REPO_ROOT

RELEASE = REPO_ROOT / "examples" / "local" / "release.yaml"


def bootstrap_registries() -> dict[str, str]:
    """name -> port, as scripts/versions.env's REGISTRIES lists what bootstrap starts."""
    text = (REPO_ROOT / "scripts" / "versions.env").read_text()
    entries = re.search(r'^REGISTRIES="([^"]+)"', text, re.M)
    assert entries, "versions.env lists no REGISTRIES"
    return dict(entry.split(":") for entry in entries.group(1).split())


def test_the_example_release_uses_the_three_regions_bootstrap_starts():
    config = load_release(RELEASE)
    ports = bootstrap_registries()
    assert {r.name: r.registry for r in config.regions} == {
        name: f"127.0.0.1:{port}" for name, port in ports.items() if name != "staging"}
    assert config.state_registry == f"127.0.0.1:{ports['staging']}"


def test_the_example_rolls_out_to_eu_west_first_then_the_rest():
    config = load_release(RELEASE)
    assert [(w.name, w.regions) for w in config.waves] == [("canary", ("eu-west",)), ("rest", ("us-east", "ap-south"))]


def test_the_demo_waits_on_nobody_a_short_soak_and_the_signature_only():
    for wave in load_release(RELEASE).waves:
        kinds = {type(g) for g in wave.gates}
        assert kinds == {SoakGate, SignatureGate}, wave.name
        assert not kinds & {PrometheusGate, ApprovalGate}
        assert all(g.seconds <= 10 for g in wave.gates if isinstance(g, SoakGate))


def test_the_rollout_trust_covers_staging_and_every_region_with_the_examples_key():
    config = load_release(RELEASE)
    trust = load_trust_config(config.trust_path)
    example = load_trust_config(Path(REPO_ROOT / "examples" / "local" / "trust.yaml"))
    assert [k.pem for k in trust.keys] == [k.pem for k in example.keys]
    assert trust.require == example.require
    for region in config.regions:
        assert trust.covers(f"{region.registry}/{region.repository}"), region.name
    assert trust.covers(f"{config.state_registry}/imagebuild-example/paddle")
