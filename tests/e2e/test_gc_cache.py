"""`imagebuild gc cache` against a real Distribution registry of the test's own, real crane images and real
cosign signatures.

The layer-cache repository holds images under the content-key tags the current plan computes (as
`imagebuild plan` prints them), under older keys no plan computes any more, one a build report still
names, and a person's tag; the staging repository holds a release tag and an image its tag moved off.
gc keeps the plan's layers, the report's, the person's and what hangs off them, deletes the rest by
digest: a dry run promises exactly what --apply deletes, and a gc stopped after its first deletion
leaves every tag on a manifest that exists, and a rerun finishes.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from imagebuild.core.report import BuildReport, LayerRecord
from imagebuild.oci import names
from imagebuild.oci.client import Registry
from imagebuild.retention import gc
from imagebuild.retention.cache import cache_live

from ..conftest import REPO_ROOT
from ..test_content_keys import KEYS
from .test_gc import OwnRegistry
from .tools import Cosign, bootstrap_key, push_tiny_image, tool

pytestmark = pytest.mark.e2e
REVISION = "0123456789abcdef0123456789abcdef01234567"


def imagebuild(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "imagebuild", *args], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=120, env=dict(os.environ))


def every_tag_resolves(registry: Registry, repository: str) -> dict[str, str]:
    found = {}
    for tag in sorted(registry.list_tags(repository)):
        digest = registry.head_manifest(repository, tag)
        assert digest is not None, f"{repository}: tag {tag} names nothing"
        assert registry.get_manifest(repository, digest)[2] == digest
        found[tag] = digest
    return found


class Stopped(Exception):
    pass


def test_gc_cache_keeps_the_plans_layers_and_the_reports_and_deletes_old_keys_as_the_dry_run_promised(tmp_path):
    own = OwnRegistry(tmp_path / "registry").start()
    try:
        matrix = tmp_path / "matrix.yaml"
        matrix.write_text(KEYS.replace("registry.example.com", own.host))
        planned = imagebuild("plan", "--matrix", str(matrix), "--revision", REVISION, "--format", "json")
        assert planned.returncode == 0, planned.stderr
        plan = json.loads(planned.stdout)
        cache_repo = plan["cache_repository"].removeprefix(own.host + "/")
        staging_repo = plan["repository"].removeprefix(own.host + "/")
        plan_tags = [layer["cache_tag"] for layer in plan["layers"]]
        assert all(names.is_layer_cache_tag(tag) for tag in plan_tags)
        cosign, key = Cosign(tool("cosign")), bootstrap_key()

        def push(repository: str, tag: str) -> str:
            return push_tiny_image(tmp_path / "images", f"{own.host}/{repository}:{tag}")

        current = {tag: push(cache_repo, tag) for tag in plan_tags[:2]}  # built at this revision
        old = {names.layer_cache_tag(kind, f"{n:x}" * 64): "" for n, kind in ((10, "base"), (11, "python"),
                                                                               (12, "release"))}
        old = {tag: push(cache_repo, tag) for tag in old}
        reported_tag, dead_signed_tag = sorted(old)[0], sorted(old)[1]
        person = push(cache_repo, "keep-for-debugging")
        for digest in (current[plan_tags[0]], old[dead_signed_tag]):
            cosign.sign(f"{own.host}/{cache_repo}@{digest}", key)
        released = push(staging_repo, "2.6.2")
        moved_off = push(staging_repo, "2.6.3")
        cosign.sign(f"{own.host}/{staging_repo}@{moved_off}", key)
        push(staging_repo, "2.6.3")  # the tag moves on: the signed image before is untagged
        kind = reported_tag.split("-")[0]
        report = BuildReport("matrix.yaml", "old", own.host, plan["repository"], plan["cache_repository"],
                             "2026-01-01T00:00:00Z", [],
                             [LayerRecord(f"{reported_tag.split('-')[1]}{'0' * 32}", kind, f"{kind}/old",
                                          f"{plan['cache_repository']}:{reported_tag}", digest=old[reported_tag])])
        report_path = tmp_path / "work" / "build-report.json"
        report_path.parent.mkdir()
        report_path.write_text(report.to_json())
        with Registry(own.host) as registry:
            before = every_tag_resolves(registry, cache_repo)
        assert before[f"{current[plan_tags[0]].replace(':', '-')}.sig"]

        args = ("gc", "--state-dir", str(tmp_path / "state"), "cache", "--matrix", str(matrix), "--revision",
                REVISION, "--report", str(report_path), "--format", "json")
        hostile = tmp_path / "hostile-report.json"
        hostile.write_text(report_path.read_text().replace(old[reported_tag], "sha256:../../other"))
        refused = imagebuild(*args[:8], "--report", str(hostile))
        assert refused.returncode == 2 and "hostile-report.json: layers[0].digest" in refused.stderr, refused.stderr
        dry = imagebuild(*args)
        assert dry.returncode == 0, dry.stderr
        promised = json.loads(dry.stdout)
        dead = {repo["role"]: [entry["digest"] for entry in repo["dead"]] for repo in promised["repositories"]}
        dead_signature = f"{old[dead_signed_tag].replace(':', '-')}.sig"
        assert set(dead["cache"]) == {old[dead_signed_tag], before[dead_signature], old[sorted(old)[2]]}
        assert dead["cache"].index(old[dead_signed_tag]) < dead["cache"].index(before[dead_signature])
        assert dead["release"][0] == moved_off and len(dead["release"]) == 2  # the image, then its signature
        assert promised["reclaimable_bytes"] > 0 and promised["deleted"] == []

        # Stopped after its first deletion, in-process: every tag left still names a manifest that exists.
        plan_tags_why = {tag: "plan" for tag in plan_tags}
        seen: list[dict] = []

        def stop_after_first(entry: dict) -> None:
            if seen:
                raise Stopped(entry["digest"])
            seen.append(entry)

        options = gc.GcOptions(apply=True, state_dir=tmp_path / "state", before_delete=stop_after_first)
        with pytest.raises(Stopped, match="sha256:"):
            gc.collect_cache_garbage(own.host, {"cache": cache_repo, "release": staging_repo},
                                     cache_live(plan_tags_why, [(str(report_path), BuildReport.read(report_path))]),
                                     options)
        with Registry(own.host) as registry:
            every_tag_resolves(registry, cache_repo)
            every_tag_resolves(registry, staging_repo)

        applied = imagebuild(*args[:-2], "--apply", "--format", "json")
        assert applied.returncode == 0, applied.stderr
        deleted = [entry["digest"] for entry in json.loads(applied.stdout)["deleted"]]
        done = [seen[0]["digest"], *deleted]
        assert sorted(done) == sorted([*dead["cache"], *dead["release"]]) and len(set(done)) == len(done)
        with Registry(own.host) as registry:
            after = every_tag_resolves(registry, cache_repo)
            staged = every_tag_resolves(registry, staging_repo)
        kept = {plan_tags[0], plan_tags[1], reported_tag, "keep-for-debugging",
                f"{current[plan_tags[0]].replace(':', '-')}.sig"}
        assert set(after) == kept
        assert after["keep-for-debugging"] == person and after[reported_tag] == old[reported_tag]
        assert set(staged) == {"2.6.2", "2.6.3"} and staged["2.6.2"] == released
        again = imagebuild(*args)
        assert again.returncode == 0, again.stderr
        assert all(repo["dead"] == [] for repo in json.loads(again.stdout)["repositories"])
    finally:
        own.stop()
