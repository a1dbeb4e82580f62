"""CI fan-out: the plan's work as levels of GitHub Actions matrices (pure: no I/O).

GitHub runs at most 256 jobs per matrix and cannot add jobs at run time beyond a matrix, so the
workflow has a fixed shape: a few layer levels, each one matrix, then the variant level, a fixed
number of matrices ("shards"). This module fills that shape:

- A layer that several of the variants need and the cache lacks is built by exactly one job of a
  layer level, and the level of a layer's job comes before the level of every job that builds on
  it. Depth among those shared layers picks the level; the last layer level takes whole subtrees
  (a layer and its shared descendants, parents first) so any depth fits.
- Each variant job releases its variants; it finds the shared layers in the cache by content key
  and builds only its own (layers no other variant uses).
- A level with more jobs than its matrices hold batches several layers or variants into one job;
  a variant batch holds one device only, so GPU variants run on GPU runners.
"""
from __future__ import annotations

import json
import math
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from imagebuild.build.plan import Plan, Variant

MAX_MATRIX = 256  # GitHub's limit on jobs per matrix
LAYER_LEVELS = 3  # the workflow's layer levels: layers1, layers2, layers3
VARIANT_SHARDS = 4  # the workflow's variant matrices: variants_1 .. variants_4
SCHEMA = "imagebuild.fanout/v1"


@dataclass(frozen=True)
class Job:
    """One matrix entry: the layers it builds (parents first) and, at the variant level, what it releases."""

    name: str  # for people (the job's title in the Actions UI)
    layers: tuple[str, ...]  # layer keys this job builds when the cache lacks them, parents first
    variants: tuple[str, ...] = ()  # variant ids it releases (variant level only)
    device: str | None = None  # "gpu" or "cpu" at the variant level: which runners take it


@dataclass(frozen=True)
class Level:
    name: str  # layers1 .. layersN, variants
    kind: str  # "layers" or "variants"
    shards: tuple[tuple[Job, ...], ...]  # one matrix each; an empty shard's job is skipped

    @property
    def jobs(self) -> tuple[Job, ...]:
        return tuple(job for shard in self.shards for job in shard)

    def output_names(self) -> list[str]:
        """The plan job's output per shard, as the workflow reads them."""
        return [f"{self.name}_{i}" for i in range(1, len(self.shards) + 1)]


@dataclass(frozen=True)
class Fanout:
    variants: tuple[str, ...]  # the variants released, in plan order
    levels: tuple[Level, ...]  # layer levels first, the variant level last

    @property
    def jobs(self) -> tuple[Job, ...]:
        return tuple(job for level in self.levels for job in level.jobs)


def changed_variants(plan: Plan, variants: Iterable[Variant], cached: Collection[str],
                     tags: Collection[str]) -> list[Variant]:
    """The variants a release on merge must handle: a tag is missing, or a layer below the release layer.

    The release layer is left out because its key carries the source revision (its labels), so
    it is new on every commit; a variant whose content did not change keeps its released image.
    """
    return [v for v in variants
            if any(t not in tags for t in v.tags) or any(k not in cached for k in v.chain[:-1])]


def plan_fanout(plan: Plan, variants: Sequence[Variant], cached: Collection[str] = frozenset(), *,
                layer_levels: int = LAYER_LEVELS, variant_shards: int = VARIANT_SHARDS,
                max_matrix: int = MAX_MATRIX) -> Fanout:
    """Levels of jobs releasing `variants`, building every layer the cache (`cached` keys) lacks once."""
    if layer_levels < 1 or variant_shards < 1 or max_matrix < 1:
        raise ValueError("layer_levels, variant_shards and max_matrix must be at least 1")
    users: dict[str, int] = {}  # layer key -> how many of the variants need it built
    for v in variants:
        for key in v.chain:
            if key not in cached:
                users[key] = users.get(key, 0) + 1
    shared = [k for k in plan.layers if users.get(k, 0) > 1]  # plan order: parents first
    depth: dict[str, int] = {}
    anchor: dict[str, str] = {}  # a last-level layer -> its ancestor at the last level's depth
    for key in shared:
        parent = plan.layers[key].parent
        depth[key] = depth[parent] + 1 if parent in depth else 0
        if depth[key] == layer_levels - 1:
            anchor[key] = key
        elif depth[key] >= layer_levels and parent is not None:
            anchor[key] = anchor[parent]
    levels = []
    for index in range(layer_levels):
        if index < layer_levels - 1:
            groups = [[k] for k in shared if depth[k] == index]
        else:
            subtrees: dict[str, list[str]] = {}
            for key in shared:
                if key in anchor:
                    subtrees.setdefault(anchor[key], []).append(key)
            groups = list(subtrees.values())
        jobs = [_layer_job(plan, keys) for keys in _batches(groups, max_matrix)]
        levels.append(Level(f"layers{index + 1}", "layers", _shards(jobs, 1)))
    levels.append(_variant_level(plan, variants, set(shared) | set(cached), variant_shards, max_matrix))
    return Fanout(variants=tuple(v.id for v in variants), levels=tuple(levels))


def _variant_level(plan: Plan, variants: Sequence[Variant], elsewhere: set[str], shards: int,
                   max_matrix: int) -> Level:
    by_device: dict[str, list[Variant]] = {}
    for v in variants:
        by_device.setdefault(v.device, []).append(v)
    capacity = shards * max_matrix
    size = max(1, math.ceil(len(variants) / capacity))
    while sum(math.ceil(len(group) / size) for group in by_device.values()) > capacity:
        size += 1  # one more per batch: each device's last batch may be partial
    jobs = []
    for device, group in sorted(by_device.items()):
        for start in range(0, len(group), size):
            batch = group[start:start + size]
            own = [k for v in batch for k in v.chain if k not in elsewhere]
            name = batch[0].id if len(batch) == 1 else f"{batch[0].id} (+{len(batch) - 1})"
            jobs.append(Job(name=name, layers=tuple(dict.fromkeys(own)), variants=tuple(v.id for v in batch),
                            device=device))
    return Level("variants", "variants", _shards(jobs, shards))


def _batches(groups: list[list[str]], max_matrix: int) -> list[list[str]]:
    """At most `max_matrix` jobs: consecutive groups merged, as evenly as their order allows."""
    if len(groups) <= max_matrix:
        return groups
    size = math.ceil(len(groups) / max_matrix)
    return [[k for group in groups[i:i + size] for k in group] for i in range(0, len(groups), size)]


def _shards(jobs: list[Job], count: int) -> tuple[tuple[Job, ...], ...]:
    """`count` contiguous slices whose sizes differ by one at most; trailing ones may be empty."""
    size = math.ceil(len(jobs) / count) if jobs else 0
    return tuple(tuple(jobs[i * size:(i + 1) * size]) for i in range(count))


def _layer_job(plan: Plan, keys: list[str]) -> Job:
    first = plan.layers[keys[0]].path
    return Job(name=first if len(keys) == 1 else f"{first} (+{len(keys) - 1} layers)", layers=tuple(keys))


# --- what `plan --format github-fanout|github-output` prints ----------------------------------


def matrix_entry(job: Job) -> dict[str, str]:
    """One `include` entry: all a job's steps read (layer keys for `build --layers`, ids for `release --only`)."""
    if job.variants:
        return {"name": job.name, "variants": ",".join(job.variants), "device": job.device or "cpu"}
    return {"name": job.name, "layers": ",".join(job.layers)}


def fanout_record(plan: Plan, fanout: Fanout) -> dict[str, Any]:
    """`plan --format github-fanout`: every level's matrices, and how much each level does."""
    return {
        "schema": SCHEMA,
        "repository": plan.repository_ref,
        "variants": list(fanout.variants),
        "levels": [
            {"name": level.name, "kind": level.kind, "outputs": level.output_names(),
             "jobs": len(level.jobs), "layers": sum(len(job.layers) for job in level.jobs),
             "shards": [{"include": [matrix_entry(job) for job in shard]} for shard in level.shards]}
            for level in fanout.levels
        ],
    }


def github_outputs(fanout: Fanout) -> list[str]:
    """`plan --format github-output`: `NAME=JSON` lines for $GITHUB_OUTPUT, one per shard.

    An empty shard's value is empty, which the workflow's `if:` reads as "skip this job": a
    matrix with no entries would fail the run instead.
    """
    lines = []
    for level in fanout.levels:
        for name, shard in zip(level.output_names(), level.shards):
            value = json.dumps({"include": [matrix_entry(job) for job in shard]}, separators=(",", ":"))
            lines.append(f"{name}={value if shard else ''}")
    lines.append(f"variants={len(fanout.variants)}")
    return lines
