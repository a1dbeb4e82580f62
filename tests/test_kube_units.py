"""imagebuild.kube without a cluster: kubeconfig reading (and its secrets kept out of every message), Lease
documents read back as untrusted input, MicroTime, lease names, and the expiry arithmetic of the lease policy.

The Kubernetes API server itself is in tests/e2e/test_kube_lease.py.
"""
from __future__ import annotations

import base64
import datetime as dt
import re
import textwrap
import uuid
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from imagebuild.core.errors import ExitCode
from imagebuild.core.source import InputError
from imagebuild.kube.client import KubeClient, KubeError, tls_context
from imagebuild.kube.config import ClusterAccess, load_kubeconfig
from imagebuild.kube.leases import (
    NAME,
    LeaseDocumentError,
    format_micro_time,
    lease_body,
    lease_name,
    parse_lease,
    parse_micro_time,
)
from imagebuild.rollout.lease import HolderPolicy, holding

CANARY = f"canary-{uuid.uuid4().hex}"


def pem_pair(common: str = "imagebuild-test") -> tuple[bytes, bytes]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    return (cert.public_bytes(serialization.Encoding.PEM),
            key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                              serialization.NoEncryption()))


def b64(data: bytes | str) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def kubeconfig(tmp_path: Path, cluster: str = "", user: str = f"token: {CANARY}", extra: str = "",
               server: str = "https://127.0.0.1:6443") -> Path:
    """A kubeconfig with one cluster `c` (CLUSTER lines added), one user `u` (USER lines) and context `ctx`."""
    path = tmp_path / "kubeconfig"
    path.write_text(textwrap.dedent("""\
        apiVersion: v1
        kind: Config
        clusters:
        - name: c
          cluster:
            server: "{server}"
        {cluster}
        users:
        - name: u
          user:
        {user}
        contexts:
        - name: ctx
          context: {{cluster: c, user: u, namespace: rollouts}}
        - name: other
          context: {{cluster: c}}
        current-context: ctx
        {extra}
        """).format(server=server, cluster=textwrap.indent(cluster, "    "), user=textwrap.indent(user, "    "),
                    extra=extra))
    return path


# --- the kubeconfig ------------------------------------------------------------------------------


def test_a_token_and_a_ca_file_relative_to_the_kubeconfig(tmp_path):
    cert, _ = pem_pair()
    (tmp_path / "ca.crt").write_bytes(cert)
    access = load_kubeconfig(kubeconfig(tmp_path, cluster="certificate-authority: ca.crt"))
    assert (access.server, access.context, access.namespace, access.ca_file, access.token) == (
        "https://127.0.0.1:6443", "ctx", "rollouts", tmp_path / "ca.crt", CANARY)
    assert CANARY not in repr(access) and "a token" == access.authentication


def test_client_certificate_data_and_a_context_asked_for(tmp_path):
    cert, key = pem_pair()
    path = kubeconfig(tmp_path, cluster=f"certificate-authority-data: {b64(cert)}",
                      user=f"client-certificate-data: {b64(cert)}\nclient-key-data: {b64(key)}")
    access = load_kubeconfig(path)
    assert (access.client_cert_pem, access.client_key_pem, access.ca_pem) == (cert, key, cert.decode())
    assert key.decode() not in repr(access) and access.authentication == "a client certificate"
    tls_context(access)  # the CA and the pair load: the key went through a private file, gone now
    other = load_kubeconfig(path, "other")
    assert (other.context, other.namespace, other.token, other.client_key_pem) == ("other", None, None, None)


def test_a_token_file_is_read_and_stripped(tmp_path):
    (tmp_path / "token").write_text(CANARY + "\n")
    assert load_kubeconfig(kubeconfig(tmp_path, user="tokenFile: token")).token == CANARY


BAD_KUBECONFIGS = [
    # (what, kubeconfig() keyword arguments, the message's key and text)
    ("exec plugin", {"user": "exec: {command: /bin/evil}"}, "users[0].user.exec: runs a program to get credentials"),
    ("no TLS verification", {"cluster": "insecure-skip-tls-verify: true"},
     "clusters[0].cluster.insecure-skip-tls-verify: imagebuild always verifies"),
    ("plain http", {"server": "http://127.0.0.1:8080"}, "clusters[0].cluster.server: 'http://127.0.0.1:8080' is not an "
                                                         "https:// URL"),
    ("credentials in the URL", {"server": f"https://admin:{CANARY}@127.0.0.1"},
     "clusters[0].cluster.server: credentials in the server URL are not supported (its value is not shown)"),
    ("basic auth", {"user": f"username: admin\npassword: {CANARY}"}, "users[0].user.username: basic authentication"),
    ("a certificate without its key", {"user": "client-certificate: /etc/hosts"},
     "users[0].user: a client certificate needs its key"),
    ("a token as a number", {"user": "token: 12345678901234567890"},
     "users[0].user.token: expected a non-empty string (its value is not shown)"),
    ("a key that is not base64", {"user": f"client-certificate: /etc/hosts\nclient-key-data: '{CANARY}!'"},
     "users[0].user.client-key-data: is not base64 (its value is not shown)"),
    ("a key that is not PEM", {"user": f"client-certificate: /etc/hosts\nclient-key-data: {b64(CANARY)}"},
     "users[0].user.client-key-data: does not decode to PEM (its value is not shown)"),
    ("an unknown user key", {"user": f"token: {CANARY}\ntoken-file: x"}, "users[0].user.token-file: unknown key"),
    ("no credentials", {"user": "extensions: []"}, "users[0].user: no credentials"),
    ("a missing CA file", {"cluster": "certificate-authority: nope.crt"}, "certificate-authority: "),
]


@pytest.mark.parametrize("arguments, message", [case[1:] for case in BAD_KUBECONFIGS],
                         ids=[case[0] for case in BAD_KUBECONFIGS])
def test_a_bad_kubeconfig_is_one_line_naming_file_line_and_key_and_never_a_secret(tmp_path, arguments, message):
    path = kubeconfig(tmp_path, **arguments)
    with pytest.raises(InputError, match=re.escape(message)) as caught:
        load_kubeconfig(path)
    text = str(caught.value)
    assert re.match(rf"{re.escape(str(path))}:\d+: ", text) and "\n" not in text, text
    assert CANARY not in text and "12345678901234567890" not in text and b64(CANARY) not in text
    assert caught.value.exit_code == ExitCode.BAD_INPUT


def test_a_token_file_holding_more_than_a_token_is_not_shown(tmp_path):
    (tmp_path / "token").write_text(f"{CANARY} {CANARY}\n")
    with pytest.raises(InputError, match=r"does not hold one token \(its content is not shown\)") as caught:
        load_kubeconfig(kubeconfig(tmp_path, user="tokenFile: token"))
    assert CANARY not in str(caught.value)


def test_the_context_must_exist_and_without_one_the_current_context_decides(tmp_path):
    with pytest.raises(InputError, match=r"contexts: no context 'prod' \(contexts: ctx, other\)"):
        load_kubeconfig(kubeconfig(tmp_path), "prod")
    path = kubeconfig(tmp_path)
    path.write_text(path.read_text().replace("current-context: ctx\n", ""))
    with pytest.raises(InputError, match=r"no current-context: name the context in release.yaml \(lease.context\)"):
        load_kubeconfig(path)


def test_a_key_that_does_not_match_its_certificate_is_refused_without_showing_it(tmp_path):
    cert, _ = pem_pair()
    _, other_key = pem_pair()
    access = load_kubeconfig(kubeconfig(tmp_path, user=f"client-certificate-data: {b64(cert)}\n"
                                                       f"client-key-data: {b64(other_key)}"))
    with pytest.raises(KubeError, match="the client certificate or its key cannot be loaded") as caught:
        tls_context(access)
    assert other_key.decode().splitlines()[1] not in str(caught.value)
    assert caught.value.exit_code == ExitCode.ENVIRONMENT


def test_an_unreachable_server_is_the_environment_and_the_token_stays_out_of_it(tmp_path):
    access = ClusterAccess(kubeconfig=tmp_path / "k", context="ctx", server="https://127.0.0.1:1", token=CANARY)
    with KubeClient(access) as client:
        assert CANARY not in repr(client)
        with pytest.raises(KubeError, match=r"kubernetes API https://127.0.0.1:1: GET /apis/coordination.k8s.io/v1/"
                                            r"namespaces/ns/leases/l: unreachable \(ConnectError") as caught:
            client.get_lease("ns", "l")
    assert CANARY not in str(caught.value) and caught.value.exit_code == ExitCode.ENVIRONMENT


# --- Lease documents -------------------------------------------------------------------------------


NOW = 1_790_000_000.25


def document(**spec: object) -> dict:
    body = lease_body("rollouts", "imagebuild-rollout-stable", holder="r1/0123456789abcdef", duration_s=30,
                      acquire_time=NOW - 5, renew_time=NOW, transitions=2,
                      annotations={"rollout.imagebuild.org/pid": "42", "rollout.imagebuild.org/host": "ci-7",
                                   "rollout.imagebuild.org/user": "release-bot"})
    body["metadata"].update(uid="6f1c2a7e-1b7d-4a5e-9a52-1f2e3d4c5b6a", resourceVersion="1234")
    body["spec"].update(spec)
    return body


def test_a_lease_reads_into_its_fields_and_expires_after_its_duration():
    lease = parse_lease(document(), "rollouts/imagebuild-rollout-stable")
    assert (lease.holder, lease.duration_s, lease.transitions, lease.resource_version) == (
        "r1/0123456789abcdef", 30, 2, "1234")
    assert (lease.renew_time, lease.acquire_time, lease.expires_at) == (NOW, NOW - 5, NOW + 30)
    assert parse_lease(document(renewTime=None), "w").expires_at is None
    assert parse_lease(document(holderIdentity=""), "w").holder is None  # released by clearing it


GARBAGE = [
    ("holderIdentity", 7, "spec.holderIdentity 7 is not a string"),
    ("holderIdentity", "x" * 2000, "spec.holderIdentity is 2000 characters long"),
    ("leaseDurationSeconds", "30", "spec.leaseDurationSeconds '30' is not a whole number of seconds"),
    ("leaseDurationSeconds", True, "spec.leaseDurationSeconds True is not a whole number"),
    ("leaseDurationSeconds", 0, "spec.leaseDurationSeconds 0 is not a whole number"),
    ("leaseDurationSeconds", 2**40, "spec.leaseDurationSeconds 1099511627776 is not a whole number of seconds "
                                    "from 1 to 2147483647"),
    ("leaseDurationSeconds", 30.5, "spec.leaseDurationSeconds 30.5 is not a whole number"),
    ("renewTime", "yesterday", "spec.renewTime 'yesterday' is not an RFC3339 micro time"),
    ("renewTime", "2026-01-02T03:04:05Z", "spec.renewTime '2026-01-02T03:04:05Z' is not an RFC3339 micro time"),
    ("renewTime", "2026-13-45T00:00:00.000000Z", "spec.renewTime '2026-13-45T00:00:00.000000Z' is not an RFC3339"),
    ("renewTime", 1790000000, "spec.renewTime 1790000000 is not an RFC3339 micro time"),
    ("renewTime", "\x1b[2J2026", "spec.renewTime '\\x1b[2J2026' is not"),
    ("acquireTime", [], "spec.acquireTime [] is not an RFC3339 micro time"),
    ("leaseTransitions", -1, "spec.leaseTransitions -1 is not a count"),
]


@pytest.mark.parametrize("key, value, message", GARBAGE, ids=[f"{c[0]}={str(c[1])[:20]!r}" for c in GARBAGE])
def test_a_lease_with_a_garbage_field_is_refused_naming_it(key, value, message):
    with pytest.raises(LeaseDocumentError, match=re.escape(f"lease rollouts/x: {message}")) as caught:
        parse_lease(document(**{key: value}), "rollouts/x")
    assert "\x1b" not in str(caught.value)


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.update(kind="Secret"), "document is kind 'Secret' of 'coordination.k8s.io/v1', not a coordination.k8s.io/v1 Lease"),
    (lambda d: d["metadata"].update(resourceVersion="12/../"), "metadata.resourceVersion '12/../' is not"),
    (lambda d: d["metadata"].pop("uid"), "metadata.uid null is not a UID"),
    (lambda d: d["metadata"].update(annotations={"a": 1}), "metadata.annotations is not a map of strings"),
    (lambda d: d["metadata"].update(name="../secrets"), "metadata.name '../secrets' is not an object name"),
    (lambda d: d.update(spec=[]), "spec is not an object"),
], ids=["kind", "resourceVersion", "uid", "annotations", "name", "spec"])
def test_a_lease_whose_metadata_cannot_be_trusted_is_refused(edit, message):
    data = document()
    edit(data)
    with pytest.raises(LeaseDocumentError, match=re.escape(message)):
        parse_lease(data, "w")


def test_micro_time_round_trips_and_needs_its_six_digits_and_a_zone():
    assert format_micro_time(1.5) == "1970-01-01T00:00:01.500000Z"
    assert parse_micro_time(format_micro_time(NOW)) == NOW
    assert parse_micro_time("1970-01-01T01:00:01.500000+01:00") == 1.5
    assert [parse_micro_time(t) for t in ("1970-01-01T00:00:01.5Z", "1970-01-01T00:00:01.500000",
                                          "1970-01-01 00:00:01.500000Z", "")] == [None] * 4


def test_each_channel_has_a_lease_name_of_its_own_and_every_name_is_valid():
    assert lease_name("stable") == "imagebuild-rollout-stable"
    assert lease_name("2.6-gpu-cuda11.8") == "imagebuild-rollout-2.6-gpu-cuda11.8"
    escaped = [lease_name(channel) for channel in ("Stable", "stable_1", "STABLE", "_x", "a" * 128, "A" * 128)]
    assert len(set(escaped + [lease_name("stable")])) == 7
    assert all(NAME.fullmatch(name) and len(name) <= 253 for name in escaped), escaped
    assert escaped[0].startswith("imagebuild-rollout.stable.")


# --- whether a lease read back holds the channel: the expiry arithmetic ------------------------------


def policy() -> HolderPolicy:
    # Only an unexpired lease of another valid rollout ID makes the policy read that rollout's record; none here.
    return HolderPolicy(store=None, rollout_id="r2", nonce="fedcba9876543210")  # type: ignore[arg-type]


@pytest.mark.parametrize("renewed_ago, blocks", [(31.0, False), (30.0, False), (29.0, True), (-100.0, True)])
def test_a_lease_holds_until_its_renew_time_plus_its_duration(renewed_ago, blocks):
    held = holding(parse_lease(document(renewTime=format_micro_time(NOW - renewed_ago)), "w"))
    assert held is not None and held["expires_at"] == NOW - renewed_ago + 30
    # The holder is rollout r1, but its record is only read for an unexpired lease of r1: make it ours to skip that.
    assert policy().blocking({**held, "rollout": "r2", "host": "elsewhere"}, NOW) is blocks


def test_who_holds_it_is_said_from_the_annotations_escaped():
    held = holding(parse_lease(document(), "w"))
    assert held == {"expires_at": NOW + 30, "rollout": "r1", "nonce": "0123456789abcdef", "host": "ci-7",
                    "user": "release-bot", "pid": 42}
    assert HolderPolicy.describe(held, NOW + 10) == "rollout r1 (user release-bot on ci-7, pid 42) holds it for another 20s"
    foreign = holding(parse_lease(document(holderIdentity="\x1b[31mkube-controller"), "w"))
    assert foreign is not None and policy().blocking(foreign, NOW)
    assert HolderPolicy.describe(foreign, NOW) == ("holder '\\x1b[31mkube-controller' (not an imagebuild rollout) "
                                                   "holds it for another 30s")
    assert not policy().blocking(foreign, NOW + 30)  # expired: whoever held it, it is free


def test_a_holder_without_a_renew_time_holds_the_channel_and_says_how_to_clear_it():
    held = holding(parse_lease(document(renewTime=None), "rollouts/imagebuild-rollout-stable"))
    assert held is not None and policy().blocking(held, NOW + 10**9)
    assert HolderPolicy.describe(held, NOW) == (
        "an unreadable lease holds it (lease rollouts/imagebuild-rollout-stable has a holder but no spec.renewTime); "
        "delete it if no rollout runs")


def test_a_released_lease_or_none_at_all_holds_nothing():
    assert holding(None) is None
    assert holding(parse_lease(document(holderIdentity=None), "w")) is None
    assert not policy().blocking(None, NOW)


def test_a_pid_annotation_that_is_not_a_number_is_no_pid():
    data = document()
    data["metadata"]["annotations"]["rollout.imagebuild.org/pid"] = "42; rm -rf /"
    held = holding(parse_lease(data, "w"))
    assert held is not None and held["pid"] is None
