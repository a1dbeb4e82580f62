"""When a promote is a rerun (push.already_there): nothing is copied only if the target already holds
the image and, as its signature and attestation tags, the very manifests verified in the source."""
from __future__ import annotations

from imagebuild.release import push_plan as plan
from imagebuild.release.push import already_there
from imagebuild.trust.verify import Evidence, signature_tag

DIGEST = "sha256:" + "a" * 64
SIG, ATT = signature_tag(DIGEST, ".sig"), signature_tag(DIGEST, ".att")
SIG_MANIFEST, ATT_MANIFEST = "sha256:" + "5" * 64, "sha256:" + "7" * 64
EVIDENCE = Evidence(manifests={SIG: (b"{}", "application/vnd.oci.image.manifest.v1+json", SIG_MANIFEST),
                               ATT: (b"{}", "application/vnd.oci.image.manifest.v1+json", ATT_MANIFEST)})
PRESENT = [plan.TagDecision("3.3.1", plan.TagAction.PRESENT, DIGEST, DIGEST)]
HELD = {DIGEST: DIGEST, SIG: SIG_MANIFEST, ATT: ATT_MANIFEST}


def test_everything_in_place_is_a_rerun():
    assert already_there(DIGEST, PRESENT, HELD, EVIDENCE)


def test_a_tag_still_to_write_is_not_a_rerun():
    decisions = [*PRESENT, plan.TagDecision("latest", plan.TagAction.WRITE, None, DIGEST)]
    assert not already_there(DIGEST, decisions, HELD, EVIDENCE)


def test_a_target_lacking_the_image_is_not_a_rerun():
    assert not already_there(DIGEST, PRESENT, {**HELD, DIGEST: None}, EVIDENCE)


def test_a_signature_or_attestation_tag_naming_other_manifests_is_not_a_rerun():
    other = "sha256:" + "9" * 64
    assert not already_there(DIGEST, PRESENT, {**HELD, SIG: other}, EVIDENCE)
    assert not already_there(DIGEST, PRESENT, {**HELD, ATT: None}, EVIDENCE)


def test_no_attestations_in_the_source_and_none_in_the_target_is_a_rerun():
    only_signed = Evidence(manifests={SIG: EVIDENCE.manifests[SIG]})
    assert already_there(DIGEST, PRESENT, {**HELD, ATT: None}, only_signed)
    assert not already_there(DIGEST, PRESENT, HELD, only_signed)
