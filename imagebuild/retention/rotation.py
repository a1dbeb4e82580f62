"""Key rotation: `imagebuild sign --resign` signs again, with the new key, every digest gc keeps in the regions.

The rehearsed rotation (README, "Rotating the signing key"):
1. add the new public key to the trust file: both keys are accepted;
2. `imagebuild sign --resign --release release.yaml --key NEW` (this module): for every live digest of
   every region (retention.gc's live set: channel tags, rollback targets, kept releases, quarantined
   digests, index children) that verifies now under the trust file, a signature by the new key and,
   for each attestation that verifies now, the same predicate attested again by the new key;
3. `imagebuild policies generate` from the trust file;
4. retire the old key (drop it from the trust file, regenerate): an image only the old key signed is
   then refused everywhere, and nothing live needs the old key's signatures.

Nothing is signed that does not verify first: a re-signing run would otherwise launder a digest someone
pushed with a forged signature into one the new key vouches for. Only predicates that verified (by a
trusted key, about this very digest; for several of a kind, the one verify chooses) are attested again.
A rerun skips what the new key already covers, so a run stopped part-way is finished by the next.
"""
from __future__ import annotations

import json
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from imagebuild.config.release_file import ReleaseConfig
from imagebuild.config.trust import PublicKey, TrustConfig
from imagebuild.core.errors import ImagebuildError
from imagebuild.oci.client import ImageRef, Registry
from imagebuild.retention.gc import GcOptions, plan_gc
from imagebuild.retention.live import Collection, cosign_tag_subject
from imagebuild.rollout.lease import open_lease
from imagebuild.rollout.state import open_store, region_registry
from imagebuild.trust import attest
from imagebuild.trust import sign as signing
from imagebuild.trust.verify import Verifier

RESIGN_HOLDER = "resign"  # the lease holder's name while re-signing (as gc's: a rerun on this host takes it over)
_KINDS = {kind.predicate_type: kind for kind in (*attest.KINDS, attest.OPENVEX)}


class ResignError(ImagebuildError):
    """The new key's public half could not be had, or cosign failed."""


@dataclass
class Resigned:
    """One digest of one region: what the new key added."""

    image: str
    signed: bool = False  # a new signature was added (False: the new key had signed it already)
    attested: list[str] = field(default_factory=list)  # attestation kinds attested again
    refused: str | None = None  # it does not verify now: nothing was signed
    skipped: list[str] = field(default_factory=list)  # attestation types the new key cannot attest again

    def to_dict(self) -> dict[str, Any]:
        return {"image": self.image, "signed": self.signed, "attested": self.attested, "refused": self.refused,
                "skipped": self.skipped}


def subjects(collection: Collection) -> list[str]:
    """The live digests that are images or indexes (not the signature and attestation manifests of one)."""
    hanging = {digest for tag, digest in collection.view.tags.items() if cosign_tag_subject(tag) is not None}
    return [digest for digest in collection.live if digest in collection.view.manifests and digest not in hanging]


def new_key_only(config: TrustConfig, pem: str) -> TrustConfig:
    """The trust file with the new key alone: what is true of an image once the old key is retired."""
    return replace(config, keys=(PublicKey("new-key", pem, "cosign public-key"),))


@dataclass
class Resigner:
    trust: TrustConfig
    options: signing.SignOptions
    cosign: signing.Cosign
    workdir: Path
    on_event: Callable[[str], None] = lambda line: None

    def new_public_key(self) -> str:
        with tempfile.TemporaryDirectory(prefix="imagebuild-resign-") as scratch:
            outfile = Path(scratch) / "new.pub"
            result = self.cosign.run(signing.public_key_argv(self.cosign.path, self.options, outfile),
                                     secrets=signing.secret_values(self.options), log=None,
                                     timeout=self.options.timeout_s)
            if result.returncode != 0:
                raise ResignError(f"cosign public-key failed (exit {result.returncode}): {result.output[-500:]}")
            return outfile.read_text(encoding="ascii")

    def _cosign(self, argv: list[str], what: str) -> None:
        log = self.workdir / "cosign.log"
        result = self.cosign.run(argv, secrets=signing.secret_values(self.options), log=log,
                                 timeout=self.options.timeout_s)
        if result.returncode != 0:
            raise ResignError(f"{what}: cosign exited {result.returncode} (log {log}): {result.output[-500:]}")

    def resign(self, images: Iterable[str], between: Callable[[], None] = lambda: None) -> list[Resigned]:
        """Each image in turn; `between` runs before each (the lease's renewal)."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        pem = self.new_public_key()
        results = []
        with Verifier(self.trust, cache_ttl_seconds=0) as now, \
                Verifier(new_key_only(self.trust, pem), check_attestations=False, cache_ttl_seconds=0) as after:
            for image in images:
                between()
                results.append(self._one(image, now, after))
        return results

    def _one(self, image: str, now: Verifier, after: Verifier) -> Resigned:
        outcome = Resigned(image)
        verdict = now.verify(image)
        if not verdict.allowed:
            outcome.refused = verdict.reason
            self.on_event(f"{image}: does not verify now, not signed: {verdict.reason}")
            return outcome
        trusted = now.inspect(image)
        covered = after.inspect(image)
        if covered.key is None:
            self._cosign(signing.sign_argv(self.cosign.path, image, self.options), f"signing {image}")
            outcome.signed = True
        for predicate_type, attestation in sorted(trusted.attestations.items()):
            if predicate_type in covered.attestations:
                continue  # the new key attested this kind already (a rerun)
            kind = _KINDS.get(predicate_type)
            if kind is None:
                outcome.skipped.append(predicate_type)
                continue
            digest = ImageRef.parse(image).digest or ""
            predicate = self.workdir / f"{digest.replace(':', '-')}-{kind.name}.json"
            predicate.write_text(json.dumps(attestation.predicate, sort_keys=True))
            self._cosign(signing.attest_argv(self.cosign.path, image, kind, predicate, self.options),
                         f"attesting {kind.name} of {image}")
            outcome.attested.append(kind.name)
        self.on_event(f"{image}: {'signed' if outcome.signed else 'signature already by the new key'}"
                      f"{'; attested ' + ', '.join(outcome.attested) if outcome.attested else ''}")
        return outcome


def live_images(config: ReleaseConfig, options: GcOptions) -> list[str]:
    """Every live image and index of every region, as REGISTRY/REPOSITORY@DIGEST (gc's live set, read now)."""
    store = open_store(config)
    registries: dict[str, Registry] = {}
    try:
        for region in config.regions:
            registries[region.name] = region_registry(region)
        plan = plan_gc(config, store, registries, options.retention, options.timing.clock())
    finally:
        for registry in registries.values():
            registry.close()
        store.registry.close()
    return [config.region(name).image(digest) for name, collection in plan.collections.items()
            for digest in subjects(collection)]


def resign_release(config: ReleaseConfig, resigner: Resigner, options: GcOptions,
                   extra: Iterable[str] = ()) -> list[Resigned]:
    """Re-sign the release's live images (and `extra` digests, e.g. staging candidates) holding every
    channel's lease, so that no rollout copies a digest in while the set is being covered."""
    store = open_store(config)
    lease = open_lease(config, store, config.channels, RESIGN_HOLDER, settle_s=options.timing.settle_s,
                       sleep=options.timing.sleep, clock=options.timing.lease_clock)
    try:
        lease.acquire()
        images = [*live_images(config, options), *extra]
        return resigner.resign(dict.fromkeys(images), between=lease.renew)
    finally:
        lease.release()
        lease.close()
        store.registry.close()
