"""release.yaml: what a valid file means, and every bad one refused in one line through the CLI (exit 2)."""
from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from imagebuild.config.release_file import (
    ApprovalGate,
    CredentialRef,
    HttpGate,
    LeaseCluster,
    PrometheusGate,
    SignatureGate,
    SmokeGate,
    SoakGate,
    load_release,
    parse_duration,
)
from imagebuild.core.source import InputError

from .conftest import run_imagebuild

DIGEST = "sha256:" + "ab" * 32

VALID = """\
schema: 1
trust: trust.yaml
state: {registry: 127.0.0.1:5000, repository: imagebuild/rollouts}
lease_ttl: 10m
regions:
  - name: eu-west
    registry: 127.0.0.1:5001
    repository: imagebuild/paddle
    harbor_project: paddle
    credentials: {docker_config: /etc/imagebuild/config.json}
  - name: us-east
    registry: 127.0.0.1:5002
    repository: imagebuild/paddle
    credentials: {env: US_EAST_REGISTRY_AUTH}
  - name: ap-south
    registry: 127.0.0.1:5003
    repository: imagebuild/paddle
channels: ["2.6-gpu-cuda11.8", stable]
waves:
  - name: canary
    regions: [eu-west]
    gates:
      soak: 30s
      signature: true
      smoke: {tier: abi}
      prometheus: {url: "http://127.0.0.1:9090", query: 'job_error_ratio{region="{region}"}', max: 0.05, for: 10s}
      http: {url: "http://127.0.0.1:8080/healthz?region={region}", expect_status: 200, timeout: 5s}
      approval: true
  - name: rest
    regions: [us-east, ap-south]
    gates: {soak: 1h, signature: true}
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "release.yaml"
    path.write_text(text)
    return path


def test_a_valid_release_reads_into_the_model(tmp_path):
    config = load_release(write(tmp_path, VALID))
    assert config.trust_path == tmp_path / "trust.yaml"
    assert (config.state_registry, config.state_repository, config.lease_ttl_s) == (
        "127.0.0.1:5000", "imagebuild/rollouts", 600.0)
    assert [r.name for r in config.regions] == ["eu-west", "us-east", "ap-south"]
    assert config.region("eu-west").credentials == CredentialRef(docker_config=Path("/etc/imagebuild/config.json"))
    assert config.region("us-east").credentials == CredentialRef(env="US_EAST_REGISTRY_AUTH")
    assert config.region("ap-south").credentials is None
    assert config.region("eu-west").harbor_project == "paddle"
    assert config.channels == ("2.6-gpu-cuda11.8", "stable")
    canary, rest = config.waves
    assert canary.regions == ("eu-west",) and rest.regions == ("us-east", "ap-south")
    assert canary.gates == (
        SoakGate(30.0), SignatureGate(), SmokeGate("abi"),
        PrometheusGate("http://127.0.0.1:9090", 'job_error_ratio{region="{region}"}', 0.05, None, 10.0),
        HttpGate("http://127.0.0.1:8080/healthz?region={region}", 200, 5.0), ApprovalGate())
    assert rest.gates == (SoakGate(3600.0), SignatureGate())
    assert [g.kind for g in canary.gates] == ["soak", "signature", "smoke", "prometheus", "http", "approval"]


def test_a_lease_key_names_the_cluster_and_a_relative_kubeconfig_is_beside_the_release(tmp_path):
    assert load_release(write(tmp_path, VALID)).lease_cluster is None  # the state repository's lease tag
    config = load_release(write(tmp_path, VALID.replace("lease_ttl: 10m\n", "lease_ttl: 10m\nlease:\n"
                                                        "  kubeconfig: kube/config\n  namespace: rollouts\n")))
    assert config.lease_cluster == LeaseCluster(tmp_path / "kube" / "config", "rollouts", None)
    config = load_release(write(tmp_path, VALID.replace(
        "lease_ttl: 10m\n", "lease_ttl: 10m\nlease: {kubeconfig: /etc/k, namespace: ns, context: prod-east}\n")))
    assert config.lease_cluster == LeaseCluster(Path("/etc/k"), "ns", "prod-east")


def test_a_region_says_which_layer_compressions_its_engines_pull(tmp_path):
    config = load_release(write(tmp_path, VALID.replace(
        "    registry: 127.0.0.1:5003", "    registry: 127.0.0.1:5003\n    compressions: [gzip]", 1)))
    gzip_only, everything = config.region("ap-south"), config.region("eu-west")
    assert gzip_only.compressions == frozenset({"gzip"}) and everything.compressions is None
    assert gzip_only.reads(frozenset({"gzip"})) and not gzip_only.reads(frozenset({"gzip", "zstd"}))
    assert everything.reads(frozenset({"gzip", "zstd"}))


def test_durations_read_in_seconds():
    assert [parse_duration(t) for t in ("30s", "10m", "1h", "500ms", "0s")] == [30, 600, 3600, 0.5, 0]
    assert [parse_duration(t) for t in ("30", "1d", "-1s", "1.5s", "s", "")] == [None] * 6


def test_the_error_names_file_line_and_key_in_process(tmp_path):
    path = write(tmp_path, VALID.replace("soak: 1h", "soak: forever"))
    with pytest.raises(InputError, match="'forever' is not a duration") as caught:
        load_release(path)
    assert str(caught.value) == (f"{path}:31: waves[1].gates.soak: 'forever' is not a duration "
                                 f"(a whole number and ms, s, m or h: 30s, 10m, 1h)")


BAD = [
    # (what is wrong, replace this, with this, lines after the replaced text's where the error is, text of the message)
    ("unknown top-level key", "lease_ttl: 10m", "lease_tll: 10m", 0, "lease_tll: unknown key (did you mean 'lease_ttl'?)"),
    ("wrong schema", "schema: 1", "schema: 2", 0, "schema: unsupported schema 2"),
    ("bad duration", "lease_ttl: 10m", "lease_ttl: 10 minutes", 0, "lease_ttl: '10 minutes' is not a duration"),
    ("lease too short", "lease_ttl: 10m", "lease_ttl: 1s", 0, "lease_ttl: must be at least 5s"),
    ("duplicate region", "  - name: us-east", "  - name: eu-west", 0, "regions[1].name: region 'eu-west' is declared twice"),
    ("undeclared wave region", "regions: [us-east, ap-south]", "regions: [us-east, mars]", 0,
     "waves[1].regions[1]: region 'mars' is not declared under regions"),
    ("region in two waves", "regions: [us-east, ap-south]", "regions: [us-east, eu-west]", 0,
     "waves[1].regions[1]: region 'eu-west' is already in wave 'canary'"),
    ("invalid channel tag", '"2.6-gpu-cuda11.8", stable]', '"2.6 gpu", stable]', 0, "channels[0]: '2.6 gpu' is not a valid tag"),
    ("channel starting with a dot", '"2.6-gpu-cuda11.8", stable]', '".hidden", stable]', 0, "is not a valid tag"),
    ("duplicate channel", '"2.6-gpu-cuda11.8", stable]', 'stable, stable]', 0, "channels[1]: channel 'stable' is listed twice"),
    ("reserved channel", '"2.6-gpu-cuda11.8", stable]', '"sha256-abc.sig", stable]', 0, "is reserved"),
    ("password literal", "credentials: {env: US_EAST_REGISTRY_AUTH}", "credentials: {password: hunter2}", 0,
     "regions[1].credentials.password: credentials are given by reference only"),
    ("token literal", "credentials: {env: US_EAST_REGISTRY_AUTH}", "credentials: {env: X, token: abc}", 0,
     "credentials.token: credentials are given by reference only"),
    ("two credential references", "credentials: {env: US_EAST_REGISTRY_AUTH}",
     "credentials: {env: X, docker_config: /c.json}", 0, "give exactly one of docker_config"),
    ("env name not a name", "credentials: {env: US_EAST_REGISTRY_AUTH}", "credentials: {env: 'a b'}", 0,
     "'a b' is not an environment variable name"),
    ("bad registry", "registry: 127.0.0.1:5002", "registry: http://127.0.0.1:5002", 0, "is not a registry host[:port]"),
    ("bad repository", "repository: imagebuild/rollouts", "repository: Imagebuild/Rollouts", 0, "is not a repository name"),
    ("missing waves", "waves:\n", "wavez:\n", 0, "unknown key"),
    ("empty wave regions", "regions: [eu-west]\n", "regions: []\n", 0, "waves[0].regions: must not be empty"),
    ("unknown gate", "      approval: true", "      aproval: true", 0, "unknown key (did you mean 'approval'?)"),
    ("prometheus without threshold", "max: 0.05, ", "", 0, "give max, min or both"),
    ("prometheus max not a number", "max: 0.05", "max: low", 0, "prometheus.max: expected a number"),
    ("url with credentials", '"http://127.0.0.1:9090"', '"http://user:pw@127.0.0.1:9090"', 0,
     "credentials in a URL are not allowed"),
    ("http status out of range", "expect_status: 200", "expect_status: 999", 0, "must be at most 599"),
    ("unknown smoke tier", "{tier: abi}", "{tier: abj}", 0, "unknown tier 'abj' (did you mean 'abi'?)"),
    ("soak as a number", "soak: 30s", "soak: 30", 0, "expected a duration like 30s, 10m or 1h"),
    ("signature not boolean", "    gates: {soak: 1h, signature: true}", "    gates: {soak: 1h, signature: yes please}",
     0, "expected true or false"),
    ("duplicate key", "lease_ttl: 10m\n", "lease_ttl: 10m\nlease_ttl: 5m\n", 1, "lease_ttl: duplicate key"),
    ("python tag", "lease_ttl: 10m", "lease_ttl: !!python/object:os.system x", 0, "is not allowed"),
    ("lease: unknown key", "lease_ttl: 10m\n", "lease_ttl: 10m\nlease: {kubeconfig: k, namespace: ns, contxt: c}\n", 1,
     "lease.contxt: unknown key (did you mean 'context'?)"),
    ("lease: no namespace", "lease_ttl: 10m\n", "lease_ttl: 10m\nlease: {kubeconfig: k}\n", 1,
     "lease: missing required key 'namespace'"),
    ("lease: bad namespace", "lease_ttl: 10m\n", "lease_ttl: 10m\nlease: {kubeconfig: k, namespace: Rollouts_1}\n", 1,
     "lease.namespace: 'Rollouts_1' is not a namespace"),
    ("lease: a token literal", "lease_ttl: 10m\n", "lease_ttl: 10m\nlease: {kubeconfig: k, namespace: n, token: t0k}\n",
     1, "lease.token: the cluster's credentials are read from the kubeconfig; never give them here"),
    ("lease: context with a space", "lease_ttl: 10m\n",
     "lease_ttl: 10m\nlease:\n  kubeconfig: k\n  namespace: n\n  context: 'a b'\n", 4,
     "lease.context: 'a b' is not a kubeconfig context name"),
    ("prepull: a relative socket", "    registry: 127.0.0.1:5003", "    registry: 127.0.0.1:5003\n"
     "    prepull: {nodes: [{name: n1, containerd: run/c.sock}]}", 1,
     "regions[2].prepull.nodes[0].containerd: 'run/c.sock' is not an absolute path to a containerd socket"),
    ("prepull: no nodes", "    registry: 127.0.0.1:5003", "    registry: 127.0.0.1:5003\n    prepull: {nodes: []}", 1,
     "regions[2].prepull.nodes: must not be empty"),
    ("prepull: a node twice", "    registry: 127.0.0.1:5003", "    registry: 127.0.0.1:5003\n    prepull:\n      nodes:\n"
     "        - {name: n1, containerd: /run/a.sock}\n        - {name: n1, containerd: /run/b.sock}", 4,
     "regions[2].prepull.nodes[1].name: node 'n1' is listed twice"),
    ("prepull: a node's password", "    registry: 127.0.0.1:5003", "    registry: 127.0.0.1:5003\n"
     "    prepull: {nodes: [{name: n1, containerd: /run/c.sock, password: pw}]}", 1,
     "regions[2].prepull.nodes[0].password: a node pulls with its own registry configuration"),
    ("prepull: a bad timeout", "    registry: 127.0.0.1:5003", "    registry: 127.0.0.1:5003\n"
     "    prepull: {timeout: 0s, nodes: [{name: n1, containerd: /run/c.sock}]}", 1,
     "regions[2].prepull.timeout: must be at least 1s"),
    ("prepull: a bad node name", "    registry: 127.0.0.1:5003", "    registry: 127.0.0.1:5003\n"
     "    prepull: {nodes: [{name: Node_1, containerd: /run/c.sock}]}", 1,
     "regions[2].prepull.nodes[0].name: 'Node_1' is not a node name"),
    ("lease: kubeconfig a list", "lease_ttl: 10m\n", "lease_ttl: 10m\nlease: {kubeconfig: [k], namespace: n}\n", 1,
     "lease.kubeconfig: expected a string, got a list"),
    ("compressions: unknown", "    registry: 127.0.0.1:5003", "    registry: 127.0.0.1:5003\n    compressions: [gzip, lz4]",
     1, "regions[2].compressions[1]: 'lz4' is not a layer compression an engine pulls (known: gzip, zstd"),
    ("compressions: empty", "    registry: 127.0.0.1:5003", "    registry: 127.0.0.1:5003\n    compressions: []", 1,
     "regions[2].compressions: must not be empty"),
    ("compressions: estargz is gzip", "    registry: 127.0.0.1:5003",
     "    registry: 127.0.0.1:5003\n    compressions: [estargz]", 1, "eStargz is gzip to every engine"),
]


@pytest.mark.parametrize("old, new, below, message", [case[1:] for case in BAD], ids=[case[0] for case in BAD])
def test_a_bad_release_is_one_line_exit_2_and_nothing_written(tmp_path, old, new, below, message):
    assert old in VALID
    line = VALID[:VALID.index(old)].count("\n") + 1 + below
    path = write(tmp_path, VALID.replace(old, new, 1))
    state_dir = tmp_path / "state"
    run = run_imagebuild("rollout", "start", "--release", path, "--image", f"127.0.0.1:5000/imagebuild/paddle@{DIGEST}",
                         "--channel", "stable", "--state-dir", state_dir, cwd=tmp_path)
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2, run.stderr
    assert len(lines) == 1 and "Traceback" not in run.stderr and not run.stdout, run.stderr
    assert lines[0].startswith(f"error: {path}:{line}: "), lines[0]
    assert message in lines[0]
    assert not state_dir.exists()


def test_a_password_value_is_never_echoed(tmp_path):
    path = write(tmp_path, VALID.replace("credentials: {env: US_EAST_REGISTRY_AUTH}",
                                         "credentials: {password: s3cr3t-value}"))
    run = run_imagebuild("rollout", "status", "--release", path)
    assert run.returncode == 2 and "s3cr3t-value" not in run.stderr + run.stdout


def test_a_missing_release_file_is_bad_input(tmp_path):
    run = run_imagebuild("rollout", "status", "--release", tmp_path / "nope.yaml")
    assert run.returncode == 2 and run.stderr.strip() == f"error: {tmp_path / 'nope.yaml'}: file not found"


@pytest.mark.parametrize("args, message", [
    (["--channel", "stable"], "give either --image REF@DIGEST or --variant ID --workdir W"),
    (["--image", "127.0.0.1:5000/imagebuild/paddle:latest", "--channel", "stable"], "is not by digest"),
    (["--variant", "x", "--channel", "stable"], "needs --workdir"),
    (["--image", f"127.0.0.1:5000/imagebuild/paddle@{DIGEST}", "--channel", "beta"],
     "channel 'beta' is not among the release's channels"),
])
def test_bad_start_options_are_one_line_exit_2(tmp_path, args, message):
    write(tmp_path, VALID)
    (tmp_path / "trust.yaml").write_text(textwrap.dedent("""\
        schema: 1
        mode: enforce
        keys: [{name: k, path: /var/lib/imagebuild/keys/cosign.pub}]
        images: ["127.0.0.1:5000/imagebuild/**"]
        require: {attestations: [], smoke_passed: false, gate_passed: false, block_severity: null}
        failure_policy: fail
        cache_ttl_seconds: 0
        webhook: {namespace: a, name: b, image: "127.0.0.1:5000/a/b:c", port: 8443}
        """))
    run = run_imagebuild("rollout", "start", "--release", tmp_path / "release.yaml", *args,
                         "--state-dir", tmp_path / "state", cwd=tmp_path)
    assert run.returncode == 2, (run.stdout, run.stderr)
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], run.stderr
    assert not (tmp_path / "state").exists()


def test_a_bad_rollout_id_is_bad_input(tmp_path):
    path = write(tmp_path, VALID)
    run = run_imagebuild("rollout", "resume", "../../etc", "--release", path)
    assert run.returncode == 2 and "is not a rollout ID" in run.stderr
