"""imagebuild admission: the admission webhook (serve: validating and mutating) and one review judged offline."""
from __future__ import annotations

import json
import ssl
import sys
from pathlib import Path

import click

from imagebuild.admission import review as admission
from imagebuild.admission.metrics import WebhookMetrics
from imagebuild.admission.quarantine import webhook_checks
from imagebuild.admission.server import DecisionLog, ServerSettings, ServingCertificate, serve
from imagebuild.cli import LazyCommand, LazyPipelineGroup
from imagebuild.cli.common import echo, reports_input_errors, trust_file_option
from imagebuild.config.trust import FailurePolicy, Mode, TrustConfig, load_trust_config
from imagebuild.core.errors import ExitCode
from imagebuild.core.source import InputError
from imagebuild.trust.verify import Verifier

trust_option = trust_file_option(
    "The trust configuration: keys, covered images, requirements, mode, failure policy, cache TTL.", required=True)


# `image` builds, scans and signs (docker, jinja2, Trivy, cosign): imported only when it runs, so that
# `serve` starts with what the webhook needs.
_IMAGE = LazyCommand("admission_image_command:image_command",
                     "Build the webhook's image with imagebuild, then smoke-test, scan, gate and sign it, by digest.")


@click.group("admission", cls=LazyPipelineGroup, lazy_commands={"image": _IMAGE})
def admission_group() -> None:
    """The validating admission webhook: Kubernetes asks it about every Pod and Pod template.

    It verifies each container, init container, ephemeral container and image volume with the
    same checks as `imagebuild verify` and allows the object only when every image passes; the
    mutating endpoint also pins each admitted image to the digest it was verified at.
    """


@admission_group.command("serve")
@trust_option
@click.option("--tls-cert", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="PEM certificate chain the webhook presents (its Service's DNS name in the SAN).")
@click.option("--tls-key", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="PEM private key of that certificate.")
@click.option("--host", default="0.0.0.0", show_default=True, help="Address to listen on.")
@click.option("--port", default=8443, show_default=True, type=click.IntRange(1, 65535), help="HTTPS port.")
@click.option("--request-deadline", default=ServerSettings.request_deadline_s, show_default=True,
              type=click.FloatRange(0.5, 60), metavar="SECONDS",
              help="A whole request (TLS handshake, request line, headers, body) must arrive within this.")
@click.option("--max-connections", default=ServerSettings.max_connections, show_default=True,
              type=click.IntRange(1, 100000), help="Connections open at once, all clients together.")
@click.option("--max-connections-per-client", default=ServerSettings.max_connections_per_client,
              show_default=True, type=click.IntRange(1, 100000),
              help="Connections open at once from one address (an IPv6 /64).")
@reports_input_errors
def serve_command(trust_path: Path, tls_cert: Path, tls_key: Path, host: str, port: int, request_deadline: float,
                  max_connections: int, max_connections_per_client: int) -> None:
    """Serve AdmissionReview v1 over HTTPS (TLS 1.2+) until SIGTERM.

    \b
    POST /validate   the validating webhook (ValidatingWebhookConfiguration's path)
    POST /mutate     the mutating webhook: the same checks, and a JSONPatch pinning each
                     admitted image to its verified digest (repo:tag@sha256:...)
    GET  /healthz    liveness: the process answers
    GET  /readyz     readiness: 503 once SIGTERM came, while requests in flight finish
    GET  /metrics    Prometheus text format: decisions by result and reason, latency,
                     cache hits, registry errors, requests in flight

    The certificate and key are read again when their files change (a Secret's update, a
    cert-manager renewal), at most once a second: new connections get the new pair, open ones
    finish on the old. A pair that does not load is ignored, with one log line (tls_reload_failed).

    Verdicts are cached by digest for the configuration's cache_ttl_seconds, across requests;
    a tag is resolved again on every request, so a moved tag is noticed at once. A digest
    quarantined in the state repository named by the configuration's `quarantine:` is refused.
    One JSON line per decision on stderr (uid, kind, namespace/name, decision, images).

    \b
    Examples:
      imagebuild admission serve --trust policies/trust.yaml \\
          --tls-cert /tls/tls.crt --tls-key /tls/tls.key
      imagebuild admission serve --trust examples/local/trust.yaml \\
          --tls-cert cert.pem --tls-key key.pem --host 127.0.0.1 --port 9443
    """
    config = load_trust_config(trust_path)
    log = DecisionLog(sys.stderr)
    certificate = _tls(tls_cert, tls_key, log)
    verifier = Verifier(config)  # one for the whole server: its cache serves every request
    settings = ServerSettings(host=host, port=port, request_deadline_s=request_deadline,
                              max_connections=max_connections, max_connections_per_client=max_connections_per_client)
    try:
        # Verdicts from the cache are answered on the event loop; with quarantine marks to read, never.
        cached = verifier.cached if config.quarantine is None else None
        serve(settings, certificate, webhook_checks(config, verifier.verify), _policy(config), log, cached=cached,
              metrics=WebhookMetrics(cache_stats=verifier.cache_stats))
    except OSError as err:
        echo(f"error: admission serve: cannot serve on {host}:{port}: {err.strerror or err}", err=True)
        sys.exit(ExitCode.FAILED)


@admission_group.command("review")
@trust_option
@click.argument("review_file", metavar="FILE", type=click.Path(dir_okay=False, allow_dash=True, path_type=Path))
@click.option("--mutate", is_flag=True,
              help="Answer as POST /mutate does: with the JSONPatch pinning each admitted image to its digest.")
@reports_input_errors
def review_command(trust_path: Path, review_file: Path, mutate: bool) -> None:
    """Judge one AdmissionReview v1 (a file, or - for stdin) as the webhook would; print its response.

    Exit 0 when allowed, 1 when denied (a malformed review with a uid is denied too), 2 when the
    file is not a review that can be answered at all (no request.uid).

    \b
    Examples:
      imagebuild admission review --trust policies/trust.yaml review.json
      imagebuild admission review --mutate --trust trust.yaml review.json | jq -r .response.patch | base64 -d
      kubectl create -f pod.yaml --dry-run=server   # what the cluster does with the same webhook
      cat review.json | imagebuild admission review --trust trust.yaml - | jq .response
    """
    config = load_trust_config(trust_path)
    body = _read(review_file)
    verify = webhook_checks(config, Verifier(config).verify)
    outcome = admission.review(body, lambda images: {image: verify(image) for image in images}, _policy(config),
                               pin=mutate)
    if outcome.http_status != 200:
        raise InputError(str(review_file), None, "", outcome.body["error"])
    click.echo(json.dumps(outcome.body, indent=2))
    if not outcome.body["response"]["allowed"]:
        sys.exit(ExitCode.FAILED)


def _policy(config: TrustConfig) -> admission.Policy:
    return admission.Policy(enforce=config.mode is Mode.ENFORCE, fail_closed=config.failure_policy is FailurePolicy.FAIL)


def _tls(cert: Path, key: Path, log: DecisionLog) -> ServingCertificate:
    for path, what in ((cert, "--tls-cert"), (key, "--tls-key")):
        if not path.is_file():
            raise InputError(str(path), None, what, "no such file")
    try:
        return ServingCertificate(cert, key, log)
    except (ssl.SSLError, ValueError, OSError) as err:
        raise InputError(str(cert), None, "--tls-cert/--tls-key",
                         f"not a PEM certificate chain and its private key ({getattr(err, 'reason', None) or err})"
                         ) from None


def _read(path: Path) -> bytes:
    limit = admission.LIMITS.max_body_bytes
    try:
        if str(path) == "-":
            data = sys.stdin.buffer.read(limit + 1)
        else:
            with path.open("rb") as handle:
                data = handle.read(limit + 1)
    except OSError as err:
        raise InputError(str(path), None, "", err.strerror or str(err)) from None
    return data
