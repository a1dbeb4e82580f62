"""A matrix whose axes multiply past the cap is refused before anything is expanded."""
from __future__ import annotations

import time

from imagebuild.config.matrix import MAX_COMBINATIONS

from .test_matrix_errors import edit


def _with_systems(count: int) -> str:
    """VALID with `count` OS entries, all of them on the os axis."""
    specs = "".join(f"  debian12v{i}:\n    image: docker.io/library/debian:12\n    family: debian\n"
                    for i in range(count))
    names = ", ".join(f"debian12v{i}" for i in range(count))
    return edit("os:\n  debian12:\n", "os:\n" + specs + "  debian12:\n",
                "  os: [debian12]", f"  os: [{names}]")


def test_axes_that_multiply_past_the_cap_are_refused_with_one_line(tmp_path, imagebuild):
    # N os x 2 cuda x 2 python: one past the cap.
    count = MAX_COMBINATIONS // 4 + 1
    matrix = tmp_path / "matrix.yaml"
    matrix.write_text(_with_systems(count))
    started = time.monotonic()
    run = imagebuild("validate", "--matrix", matrix)
    seconds = time.monotonic() - started
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in run.stderr
    assert f"{matrix}:{20 + 3 * count}: matrix:" in lines[0]
    assert f"{count * 4:,} combinations" in lines[0]
    assert seconds < 20


def test_the_cap_itself_is_not_refused_for_size(tmp_path, imagebuild):
    matrix = tmp_path / "matrix.yaml"
    matrix.write_text(_with_systems(MAX_COMBINATIONS // 4))
    run = imagebuild("validate", "--matrix", matrix, timeout=300)
    # It expands: what stops it is the next check (OS-less tags collide), not the size.
    assert "combinations" not in run.stderr
    assert "is given to both" in run.stderr
