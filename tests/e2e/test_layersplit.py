"""The layer split, built for real: the same files as the one-layer install, in `pip_layers.parts` layers.

Two layers of the example, each built twice from a copy of the example matrix (`--layers`, so no variant
is tagged), once split and once with `parts: 1` (the Dockerfile as it was before the split):

  cuda     the wheels layer over a small stand-in wheel set (about 105 MB unpacked instead of 3 GB):
           the fetch stage's tree of libraries, split by package and by file (`--tree`)
  paddle   the CPU variant's Paddle layer: pip in place over the python layer, what it wrote found
           against a snapshot (`--since`)

Each split image has one layer per part where the one-layer image has one, every part within the bound,
and the two images' file trees (paths, types, modes, owners, sizes, contents, link targets) are the same.
Layers already in the registry are reused, so a second run only pulls and compares.
"""
from __future__ import annotations

import json
from pathlib import Path

import docker
import pytest

from .conftest import copy_matrix, imagebuild
from .filetree import differences, image_tree, layer_sizes

# NVIDIA wheels small enough for a test: one package over the fair share (nvrtc: one 54 MB library),
# one split by its files (cupti), two kept whole.
STAND_IN = ["nvidia-cuda-runtime-cu11==11.8.89", "nvidia-cuda-nvrtc-cu11==11.8.89",
            "nvidia-cuda-cupti-cu11==11.8.87", "nvidia-nvtx-cu11==11.8.86"]
CUDA_LAYER = "cuda/debian12-cuda11.8-cudnn8.6-wheels"
PADDLE_LAYER = "paddle/debian12-py3.11-paddle3.3.1"
PARTS = 3
BOUND_MIB = 60
COPY_PART = "COPY /imagebuild-split/parts/"


def build_layer(tmp_path: Path, layer: str, pip_layers: dict, wheels: list[str] | None = None) -> str:
    """Build one layer (and what it stands on) from a copy of the example; its image, pulled into the engine."""
    def edit(data: dict) -> None:
        data["pip_layers"] = pip_layers
        if wheels is not None:
            data["cuda"]["11.8"]["wheels"] = wheels

    matrix = copy_matrix(tmp_path, edit)
    run = imagebuild("build", "--matrix", str(matrix), "--workdir", str(tmp_path / "w"), "--layers", layer,
                     timeout=1800)
    assert run.returncode == 0, f"{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    report = json.loads((tmp_path / "w" / "build-report.json").read_text())
    [record] = [r for r in report["layers"] if r["path"] == layer]
    return str(record["image"])


def in_engine(engine, *images: str) -> None:
    """Each image in the engine: a layer reused from the registry was not built here."""
    for image in images:
        try:
            engine.images.get(image)
        except docker.errors.ImageNotFound:
            engine.images.pull(image)


# Run in the image: a .pyc whose recorded source time or size is not its source's is recompiled at every
# import (the image does not write bytecode), so the parts must keep the install's file times exactly.
STALE_BYTECODE = """
import os, sys
stale = fresh = 0
for top in [p for p in sys.path if p.endswith("site-packages")]:
    for folder, _, files in os.walk(top):
        for name in files if folder.endswith("__pycache__") else ():
            source = os.path.join(os.path.dirname(folder), name.split(".")[0] + ".py")
            with open(os.path.join(folder, name), "rb") as f:
                head = f.read(16)
            if int.from_bytes(head[4:8], "little") or not os.path.exists(source):
                continue
            st = os.stat(source)
            current = head[8:16] == (int(st.st_mtime) & 0xFFFFFFFF).to_bytes(4, "little") + \
                (st.st_size & 0xFFFFFFFF).to_bytes(4, "little")
            fresh, stale = fresh + current, stale + (not current)
print(fresh, stale)
"""


@pytest.fixture(scope="module")
def cuda_images(engine, staging_registry, tmp_path_factory):
    split = build_layer(tmp_path_factory.mktemp("cuda-split"), CUDA_LAYER,
                        {"parts": PARTS, "max_part_mib": BOUND_MIB}, STAND_IN)
    whole = build_layer(tmp_path_factory.mktemp("cuda-whole"), CUDA_LAYER, {"parts": 1}, STAND_IN)
    in_engine(engine, split, whole)
    return split, whole


@pytest.fixture(scope="module")
def paddle_images(engine, staging_registry, tmp_path_factory):
    split = build_layer(tmp_path_factory.mktemp("paddle-split"), PADDLE_LAYER, {"parts": PARTS})
    whole = build_layer(tmp_path_factory.mktemp("paddle-whole"), PADDLE_LAYER, {"parts": 1})
    in_engine(engine, split, whole)
    return split, whole


def check_layers(engine, crane: str, split: str, whole: str, bound: int | None) -> list[int]:
    """The split image's layers are the one-layer image's with its install replaced by PARTS parts; their sizes."""
    ours, theirs = layer_sizes(engine, split, crane), layer_sizes(engine, whole, crane)
    assert len(ours) == len(theirs) - 1 + PARTS
    parts = [layer for layer in ours if layer.created_by.startswith(COPY_PART)]
    assert [p.created_by.split()[1] for p in parts] == [f"/imagebuild-split/parts/{i}/" for i in range(1, PARTS + 1)]
    first = ours.index(parts[0])
    assert [layer.created_by for layer in ours[:first]] == [layer.created_by for layer in theirs[:first]]
    assert [layer.created_by for layer in ours[first + PARTS:]] == [layer.created_by for layer in theirs[first + 1:]]
    sizes = [p.size for p in parts]
    replaced = theirs[first].size
    # The parts hold the install's bytes once, plus the folders each part makes again above its files.
    assert replaced <= sum(sizes) <= replaced * 1.02 + 64 * 1024, (replaced, sizes)
    if bound is not None:
        assert max(sizes) <= bound, sizes
    return sizes


def test_the_wheels_layer_is_split_into_bounded_parts(engine, tools, cuda_images):
    sizes = check_layers(engine, tools["crane"], *cuda_images, bound=BOUND_MIB << 20)
    # Package by package, nvrtc's one big library alone: no part is empty and none holds most of it.
    assert min(sizes) > 5 << 20 and max(sizes) < 0.6 * sum(sizes), sizes


def test_the_split_wheels_layer_holds_the_same_files(engine, cuda_images):
    split, whole = (image_tree(engine, image) for image in cuda_images)
    assert differences(split, whole) == []
    libraries = [path for path, info in split.items() if path.startswith("/usr/local/nvidia-wheels/")
                 and info.kind == "file" and ".so" in path]
    assert len(libraries) >= 8


def test_the_paddle_layer_is_split_into_parts_of_about_a_third(engine, tools, paddle_images):
    sizes = check_layers(engine, tools["crane"], *paddle_images, bound=None)
    assert max(sizes) < 0.5 * sum(sizes), sizes  # paddle's own folder, most of the layer, was split by its files


def test_the_split_paddle_layer_holds_the_same_files_and_scripts(engine, paddle_images):
    split, whole = (image_tree(engine, image) for image in paddle_images)
    assert differences(split, whole) == []
    site = "/opt/venv/lib/python3.11/site-packages"
    assert split[f"{site}/paddle/__init__.py"].kind == "file"
    assert any(path.startswith(f"{site}/paddlepaddle-3.3.1.dist-info") for path in split)
    scripts = [path for path, info in split.items() if path.startswith("/opt/venv/bin/") and info.mode & 0o111
               and info.kind == "file"]
    assert scripts, "pip's console scripts are in the image"
    assert not [path for path in split if path.startswith("/imagebuild-split")]


def test_the_split_paddle_layers_bytecode_is_current(engine, paddle_images):
    split, _ = paddle_images
    out = engine.containers.run(split, ["python", "-c", STALE_BYTECODE], remove=True, network_disabled=True)
    fresh, stale = (int(n) for n in out.decode().split())
    assert fresh > 1000 and stale == 0
