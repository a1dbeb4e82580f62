"""What the webhook's e2e tests share: small signed and unsigned images, trust files, and the webhook process.

Nothing is mocked: images are pushed to the local registries with crane and signed with the real
cosign; the webhook is `imagebuild admission serve` in a process of its own, over TLS.
"""
from __future__ import annotations

import json
import signal
import ssl
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from .certs import Tls
from .conftest import REPO, STAGING
from .rollout_harness import free_port
from .tools import KEYS, Cosign, KeyPair, crane, push_tiny_image

OUTSIDE = "127.0.0.1:5001"  # a real registry the test policy does not cover
PREFIX = f"{STAGING}/admission-e2e"
UNREACHABLE = f"127.0.0.1:{free_port()}"
READY_TIMEOUT_S = 30.0


# --- images: tiny ones, pushed with crane and signed with cosign ----------------------------------------------


@dataclass
class Registry:
    """Pushes small distinct images and signs them, as the pipeline would, with the real tools."""

    workdir: Path
    cosign: Cosign
    key: KeyPair  # the trusted key: bootstrap's

    def push(self, repository: str, tag: str = "t") -> str:
        """A one-file image of its own at repository:tag; returns repository@digest."""
        return f"{repository}@{push_tiny_image(self.workdir, f'{repository}:{tag}')}"

    def sign(self, reference: str, key: KeyPair | None = None) -> None:
        self.cosign.sign(reference, key or self.key)

    def tag(self, by_digest: str, tag: str) -> None:
        """Point repository:tag at this digest (a tag moved after signing)."""
        crane("tag", by_digest, tag)


def unique_repository(registry: str = STAGING) -> str:
    return f"{registry}/admission-e2e/r{uuid.uuid4().hex[:10]}"


@dataclass(frozen=True)
class Images:
    signed: str  # by digest, signed with the trusted key
    signed_too: str  # another one
    unsigned: str  # by digest, never signed
    other_key: str  # by digest, signed with a key the policy does not list
    moved_tag: str  # a tag that was moved from a signed digest to an unsigned one
    outside: str  # signed with the trusted key, in a registry the policy does not cover

    @property
    def signed_tag(self) -> str:
        """`signed` by its tag: what a user writes, and what the mutating webhook pins."""
        return self.signed.split("@", 1)[0] + ":t"


def make_images(registry: Registry, other_key: KeyPair) -> Images:
    signed = registry.push(unique_repository())
    registry.sign(signed)
    signed_too = registry.push(unique_repository())
    registry.sign(signed_too)
    unsigned = registry.push(unique_repository())
    foreign = registry.push(unique_repository())
    registry.sign(foreign, other_key)
    moving = unique_repository()
    first = registry.push(moving, "release")
    registry.sign(first)
    registry.push(moving, "release")  # the same tag, now on a new digest nobody signed
    outside = registry.push(unique_repository(OUTSIDE))
    registry.sign(outside)
    return Images(signed, signed_too, unsigned, foreign, f"{moving}:release", outside)


# --- trust files ---------------------------------------------------------------------------------------------


def trust_file(directory: Path, *, mode: str = "enforce", failure_policy: str = "fail", ttl: int = 60,
               quarantine: str | None = None, images: tuple[str, ...] = (), extra: str = "") -> Path:
    """quarantine: the state repository (registry/repository) holding quarantine marks, read afresh each time;
    extra: more top-level YAML (the webhook's section, say)."""
    path = directory / f"trust-{uuid.uuid4().hex[:6]}.yaml"
    globs = "".join(f'  - "{glob}"\n' for glob in (f"{PREFIX}/**", f"{UNREACHABLE}/admission-e2e/**", *images))
    state = ""
    if quarantine:
        registry, repository = quarantine.split("/", 1)
        state = f"quarantine: {{registry: '{registry}', repository: {repository}, cache_ttl_seconds: 0}}\n"
    path.write_text(
        f"mode: {mode}\n"
        f"keys:\n  - name: imagebuild-local\n    path: {KEYS / 'cosign.pub'}\n"
        f"images:\n{globs}"
        f"require:\n  attestations: []\n"
        f"failure_policy: {failure_policy}\n"
        f"cache_ttl_seconds: {ttl}\n" + state + extra)
    return path


def until(condition: Callable[[], object], what: str, timeout: float = 20.0, interval: float = 0.05) -> None:
    """Polls condition() until it is true; a CompletedProcess counts as true when it exited 0, and the last
    one's stderr is shown when time runs out."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        last = condition()
        if last.returncode == 0 if hasattr(last, "returncode") else last:
            return
        time.sleep(interval)
    pytest.fail(f"not within {timeout:.0f} s: {what} ({getattr(last, 'stderr', last)!s:.2000})")


# --- the webhook, for real -----------------------------------------------------------------------------------


@dataclass
class Webhook:
    process: subprocess.Popen
    url: str
    client: httpx.Client
    log_path: Path
    port: int

    def review(self, document: dict, path: str = "/validate") -> dict:
        reply = self.post(json.dumps(document).encode(), path=path)
        assert reply.status_code == 200, reply.text
        answer = reply.json()
        assert (answer["apiVersion"], answer["kind"]) == ("admission.k8s.io/v1", "AdmissionReview")
        assert answer["response"]["uid"] == document["request"]["uid"]
        return answer["response"]

    def post(self, body: bytes, path: str = "/validate", **kwargs) -> httpx.Response:
        return self.client.post(f"{self.url}{path}", content=body,
                                headers={"Content-Type": "application/json", **kwargs.pop("headers", {})}, **kwargs)

    def events(self, event: str) -> list[dict]:
        """The log's JSON lines of that event, in order."""
        text = self.log_path.read_text()
        whole = text[:text.rfind("\n") + 1]  # a line the webhook is still writing is not read yet
        lines = [json.loads(line) for line in whole.splitlines() if line.startswith("{")]
        return [line for line in lines if line.get("event") == event]

    def decisions(self) -> list[dict]:
        return self.events("decision")

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.client.close()
        return self.process.returncode


def start_webhook_process(directory: Path, tls: Tls, trust: Path, *flags: str, host: str = "127.0.0.1",
                          port: int | None = None) -> Webhook:
    """`imagebuild admission serve` on host:port (a free one by default), once it answers /readyz."""
    port = port or free_port()
    log_path = directory / f"webhook-{port}-{uuid.uuid4().hex[:4]}.log"
    process = subprocess.Popen(
        [sys.executable, "-m", "imagebuild", "admission", "serve", "--trust", str(trust),
         "--tls-cert", str(tls.cert), "--tls-key", str(tls.key), "--host", host, "--port", str(port), *flags],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=log_path.open("w"))
    client = httpx.Client(verify=ssl.create_default_context(cafile=str(tls.ca)), timeout=30)
    webhook = Webhook(process, f"https://{host}:{port}", client, log_path, port)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"the webhook exited with {process.returncode}: {log_path.read_text()[-2000:]}")
        try:
            if client.get(f"{webhook.url}/readyz").status_code == 200:
                return webhook
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    webhook.stop()
    pytest.fail(f"the webhook did not become ready in {READY_TIMEOUT_S:.0f} s: {log_path.read_text()[-2000:]}")
