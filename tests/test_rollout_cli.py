"""`imagebuild rollout start --variant`: the build report must show the digest gated and signed (no registry needed)."""
from __future__ import annotations

from pathlib import Path

from imagebuild.core.report import BuildReport, GateStage, SignStage, StageStatus, VariantRecord

from .conftest import run_imagebuild
from .test_release import VALID

DIGEST = "sha256:" + "cd" * 32


def workdir_with(tmp_path: Path, *stages) -> Path:
    work = tmp_path / "work"
    work.mkdir()
    variant = VariantRecord(id="v-cpu", tags=["v-cpu"], images=["127.0.0.1:5000/imagebuild/paddle:v-cpu"],
                            chain=["k0"], device="cpu", paddle="3.3.1", python="3.11", cuda=None, cudnn=None,
                            os="debian12", digest=DIGEST, image=f"127.0.0.1:5000/imagebuild/paddle@{DIGEST}",
                            stages={stage.STAGE: stage for stage in stages})
    BuildReport(matrix="matrix.yaml", revision="r", registry="127.0.0.1:5000", repository="imagebuild/paddle",
                cache_repository="imagebuild/cache", created="2026-01-01T00:00:00Z", variants=[variant],
                layers=[]).write(work / "build-report.json")
    (tmp_path / "release.yaml").write_text(VALID)
    return work


def start(tmp_path: Path, work: Path, variant: str = "v-cpu"):
    return run_imagebuild("rollout", "start", "--release", tmp_path / "release.yaml", "--variant", variant,
                          "--workdir", work, "--channel", "stable", "--state-dir", tmp_path / "state")


def test_a_variant_not_signed_for_its_digest_is_refused(tmp_path):
    work = workdir_with(tmp_path, GateStage(status=StageStatus.PASSED, digest=DIGEST))
    run = start(tmp_path, work)
    assert run.returncode == 1
    assert run.stderr.strip() == (f"error: rollout: refusing to roll out 127.0.0.1:5000/imagebuild/paddle@{DIGEST}: "
                                  f"the build report does not show it signed for this digest (run imagebuild sign)")
    assert not (tmp_path / "state").exists()


def test_a_variant_gated_for_another_digest_is_refused(tmp_path):
    work = workdir_with(tmp_path, GateStage(status=StageStatus.PASSED, digest="sha256:" + "00" * 32),
                        SignStage(status=StageStatus.PASSED, digest=DIGEST))
    run = start(tmp_path, work)
    assert run.returncode == 1 and "does not show it gated" in run.stderr


def test_an_unknown_variant_is_bad_input(tmp_path):
    work = workdir_with(tmp_path)
    run = start(tmp_path, work, "v-gpu")
    assert run.returncode == 2 and "no variant 'v-gpu' in the build report" in run.stderr
