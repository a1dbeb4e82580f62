"""The layer split (imagebuild/build/layersplit.py): the partition, pure, and the moves it makes on a real
file system (a temp folder standing in for the build's root).

The e2e side (tests/e2e/test_layersplit.py) builds the rendered Dockerfiles and compares the images' files.
"""
from __future__ import annotations

import os
import random
import stat
from pathlib import Path

import pytest

from imagebuild.build.layersplit import (
    TAR_BLOCK,
    Entry,
    Package,
    Piece,
    SplitError,
    changes,
    folders_above,
    main,
    package_of,
    packages_of,
    partition,
    tar_bytes,
    walk,
)

MIB = 1 << 20


def package(name: str, *sizes: int) -> Package:
    return Package(name, tuple(Piece((f"{name}/f{i}",), size) for i, size in enumerate(sizes)))


def names(part) -> list[str]:
    return [unit.name for unit in part.units]


# --- the partition --------------------------------------------------------------------------


def test_packages_go_largest_first_onto_the_smallest_part():
    parts = partition([package("a", 50), package("b", 40), package("c", 30), package("d", 20), package("e", 10)], 3,
                      max_bytes=None)
    # a, b, c one each; d onto c's part (30), e onto b's (40 < 50).
    assert [names(p) for p in parts] == [["a"], ["b", "e"], ["c", "d"]]
    assert [p.size for p in parts] == [50, 50, 50]


def test_a_package_over_the_fair_share_is_split_by_its_files():
    """Paddle's own folder is most of its layer: kept whole it would be one part of nearly everything."""
    paddle = package("site-packages/paddle", *([100] * 24))  # 2,400
    parts = partition([paddle, package("site-packages/numpy", 300), package("site-packages/scipy", 200)], 4)
    assert sum(p.size for p in parts) == 2900
    assert max(p.size for p in parts) <= 800  # the fair share is 725: within one piece of it
    assert all(any(u.name.startswith("site-packages/paddle (") for u in p.units) for p in parts)
    assert ["site-packages/numpy"] in [[u.name for u in p.units if "paddle" not in u.name] for p in parts]


def test_packages_within_the_fair_share_stay_whole():
    parts = partition([package("a", 40, 40), package("b", 30, 30), package("c", 20, 20)], 2)  # share: 90
    assert [names(p) for p in parts] == [["a"], ["b", "c"]]


def test_every_path_lands_in_exactly_one_part_and_no_part_is_far_over_the_share():
    rng = random.Random(22)
    for _ in range(200):
        packages = [package(f"p{i}", *[rng.randint(0, 5 * MIB) for _ in range(rng.randint(1, 12))])
                    for i in range(rng.randint(0, 30))]
        count = rng.randint(1, 8)
        parts = partition(packages, count)
        assert len(parts) == count
        placed = [path for part in parts for path in part.paths]
        wanted = [piece.paths[0] for p in packages for piece in p.pieces]
        assert sorted(placed) == sorted(wanted)
        share = -(-sum(p.size for p in packages) // count)
        largest = max((unit.size for part in parts for unit in part.units), default=0)
        assert largest <= share or largest in [piece.size for p in packages for piece in p.pieces]
        # Each unit went onto the smallest part, which held at most the share then.
        assert max(p.size for p in parts) <= share + largest


def test_the_partition_is_the_same_for_the_same_packages_in_any_order():
    packages = [package(f"p{i}", i * 10, 7) for i in range(12)]
    shuffled = list(packages)
    random.Random(1).shuffle(shuffled)
    assert partition(packages, 4) == partition(shuffled, 4)


def test_fewer_packages_than_parts_splits_them_into_files():
    parts = partition([package("nvidia/cudnn", 300, 200, 100), package("nvidia/cublas", 250, 150)], 4)
    assert all(p.units for p in parts)
    assert sorted(p.size for p in parts) == [200, 250, 250, 300]


def test_fewer_files_than_parts_leaves_the_last_parts_empty():
    """The Dockerfile's COPY lines are fixed; an empty part is an empty layer (BuildKit still makes one)."""
    parts = partition([package("tiny", 10, 20)], 4)
    assert [p.size for p in parts] == [20, 10, 0, 0]
    assert partition([], 3) == [type(parts[0])(())] * 3


def test_one_part_is_everything():
    packages = [package("a", 5, 6), package("b", 7)]
    [only] = partition(packages, 1)
    assert only.size == 18 and len(only.paths) == 3


def test_a_bound_below_the_fair_share_splits_more_packages_and_holds():
    packages = [package("a", *([10] * 10)), package("b", 30), package("c", 30)]  # 160 in all
    parts = partition(packages, 4, max_bytes=45)
    assert max(p.size for p in parts) <= 45
    assert sum(p.size for p in parts) == 160


def test_a_bound_the_parts_cannot_hold_fails_and_says_what_to_change():
    with pytest.raises(SplitError, match="would hold") as caught:
        partition([package("paddle", 900), package("numpy", 100)], 2, max_bytes=600)
    message = str(caught.value)
    assert "part 1 would hold 900 bytes, over the bound of 600" in message
    assert "its largest piece: paddle, 900 bytes" in message
    assert "pip_layers.parts or pip_layers.max_part_mib" in message


def test_zero_parts_is_refused():
    with pytest.raises(SplitError, match="at least 1"):
        partition([package("a", 1)], 0)


def test_tar_bytes_count_the_header_and_whole_blocks():
    assert [tar_bytes(n) for n in (0, 1, 512, 513)] == [512, 1024, 1024, 1536]


# --- packages -------------------------------------------------------------------------------


@pytest.mark.parametrize("path, roots, expected", [
    ("/opt/venv/lib/python3.11/site-packages/paddle/base/core.so", (), "/opt/venv/lib/python3.11/site-packages/paddle"),
    ("/opt/venv/lib/python3.11/site-packages/six.py", (), "/opt/venv/lib/python3.11/site-packages/six.py"),
    ("/usr/lib/python3/dist-packages/yaml/__init__.py", (), "/usr/lib/python3/dist-packages/yaml"),
    ("/usr/local/nvidia-wheels/cudnn/lib/libcudnn.so.8", ("/usr/local/nvidia-wheels",), "/usr/local/nvidia-wheels/cudnn"),
    ("/usr/local/nvidia-wheels/cudnn/lib/libcudnn.so.8", (), "/usr/local/nvidia-wheels/cudnn/lib"),
    ("/opt/venv/bin/paddle", (), "/opt/venv/bin"),
    ("/top", (), "/"),
])
def test_the_package_of_a_path(path, roots, expected):
    assert package_of(path, roots) == expected


def entry(kind: str = "f", size: int = 0, inode: int = 1, links: int = 1, mtime: int = 1, mode: int = 0o644) -> Entry:
    return Entry(kind, mode, 0, 0, size, mtime, mtime, inode, links)


SITE = "/opt/venv/lib/python3.11/site-packages"


def test_what_an_install_wrote_is_grouped_into_packages_of_pieces():
    written = {
        SITE: entry("d", inode=1),
        f"{SITE}/paddle": entry("d", inode=2),
        f"{SITE}/paddle/libphi.so": entry("f", 1000, inode=3),
        f"{SITE}/paddle/libs": entry("d", inode=4),  # empty: a piece of its own
        f"{SITE}/paddle/same.so": entry("f", 600, inode=5, links=2),
        f"{SITE}/paddle/also.so": entry("f", 600, inode=5, links=2),
        f"{SITE}/paddle/link.so": entry("l", inode=6),
        "/opt/venv/bin/fleetrun": entry("f", 10, inode=7),
    }
    by_name = {p.name: p for p in packages_of(written)}
    assert set(by_name) == {f"{SITE}/paddle", "/opt/venv/bin"}
    paddle = by_name[f"{SITE}/paddle"]
    assert [piece.paths for piece in paddle.pieces] == [
        (f"{SITE}/paddle/also.so", f"{SITE}/paddle/same.so"),  # one file, two names: never parted
        (f"{SITE}/paddle/libphi.so",), (f"{SITE}/paddle/libs",), (f"{SITE}/paddle/link.so",)]
    assert paddle.size == (tar_bytes(600) + TAR_BLOCK) + tar_bytes(1000) + TAR_BLOCK + TAR_BLOCK


def test_changes_are_what_is_new_or_different():
    before = {"/a": entry(), "/b": entry(mtime=1), "/c": entry(links=1)}
    after = {"/a": entry(), "/b": entry(mtime=2), "/c": entry(links=3), "/d": entry()}
    assert set(changes(before, after)) == {"/b", "/d"}  # a new name of /c is not a change of /c


def test_an_install_that_removes_a_file_below_it_is_refused():
    before = {f"/x/{i}": entry() for i in range(7)}
    with pytest.raises(SplitError, match="removed") as caught:
        changes(before, {"/x/0": entry()})
    assert "removed 6 path(s) of the layer below (/x/1, /x/2, /x/3, /x/4, /x/5 and 1 more)" in str(caught.value)
    assert "pip_layers.parts: 1" in str(caught.value)


def test_folders_above_are_parents_first_without_the_root():
    assert folders_above(("/a/b/c", "/a/d")) == ["/a", "/a/b"]


# --- on a real file system ------------------------------------------------------------------


def tree(root: Path) -> dict[str, tuple]:
    """Every path under root: type, mode, owner, size or link target, and which names share an inode."""
    out: dict[str, tuple] = {}
    inodes: dict[int, str] = {}
    for path in sorted(root.rglob("*")):
        st = path.lstat()
        rel = "/" + str(path.relative_to(root))
        what = os.readlink(path) if path.is_symlink() else (path.read_bytes() if path.is_file() else None)
        first = inodes.setdefault(st.st_ino, rel) if stat.S_ISREG(st.st_mode) else rel
        out[rel] = (stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, what, first,
                    st.st_mtime_ns if not stat.S_ISDIR(st.st_mode) else None)
    return out


def make_install(root: Path) -> None:
    (root / "nvidia" / "cudnn" / "lib").mkdir(parents=True)
    (root / "nvidia" / "cublas" / "lib").mkdir(parents=True)
    (root / "nvidia" / "empty").mkdir()
    (root / "nvidia" / "cudnn" / "lib" / "libcudnn.so.8").write_bytes(os.urandom(300_000))
    (root / "nvidia" / "cudnn" / "lib" / "libcudnn_ops.so.8").write_bytes(os.urandom(200_000))
    (root / "nvidia" / "cublas" / "lib" / "libcublas.so.11").write_bytes(os.urandom(250_000))
    os.link(root / "nvidia" / "cublas" / "lib" / "libcublas.so.11", root / "nvidia" / "cublas" / "lib" / "hard")
    (root / "nvidia" / "cublas" / "lib" / "libcublas.so").symlink_to("libcublas.so.11")
    (root / "nvidia" / "__init__.py").write_text("")
    os.chmod(root / "nvidia" / "cublas", 0o750)
    os.chmod(root / "nvidia" / "cudnn" / "lib" / "libcudnn.so.8", 0o755)


def test_split_of_a_tree_moves_every_file_into_one_part_with_its_folders_made_again(tmp_path, capsys):
    source = tmp_path / "fetch" / "opt" / "wheels"
    make_install(source)
    expected = tree(source / "nvidia")
    image = tmp_path / "image"
    image.mkdir(mode=0o711)
    out = tmp_path / "split" / "parts"
    code = main(["split", "--parts", "3", "--package-root", str(image / "nvidia"), "--tree", str(source / "nvidia"),
                 "--dest", str(image / "nvidia"), str(out)])
    assert code == 0
    printed = capsys.readouterr().out.splitlines()
    assert [line.split(":")[1] for line in printed] == [" part 1", " part 2", " part 3"]
    assert not [p for p in (source / "nvidia").rglob("*") if not p.is_dir()], "every file moved out"
    # Copied over one another, as the Dockerfile's COPY lines do, the parts are the install.
    merged: dict[str, tuple] = {}
    for i in (1, 2, 3):
        part = out / str(i) / str(image).lstrip("/")
        assert (out / str(i)).is_dir()
        for path, what in tree(part / "nvidia").items():
            assert merged.setdefault(path, what) == what, f"{path} differs between parts"
        assert stat.S_IMODE((out / str(i) / str(image).lstrip("/")).stat().st_mode) == 0o711
    assert {p: w[:5] for p, w in merged.items()} == {p: w[:5] for p, w in expected.items()}
    assert {p: w[6] for p, w in merged.items()} == {p: w[6] for p, w in expected.items()}  # file times kept
    hard = [p for p, w in merged.items() if w[5] != p]
    assert hard == ["/cublas/lib/libcublas.so.11"] or hard == ["/cublas/lib/hard"]  # still one inode


def test_split_since_a_snapshot_takes_only_what_changed(tmp_path):
    root = tmp_path / "root"
    (root / "venv" / "site-packages" / "pip").mkdir(parents=True)
    (root / "venv" / "site-packages" / "pip" / "__init__.py").write_text("old")
    (root / "venv" / "bin").mkdir()
    before = walk(str(root), ())
    (root / "venv" / "site-packages" / "paddle").mkdir()
    (root / "venv" / "site-packages" / "paddle" / "core.so").write_bytes(b"x" * 5000)
    (root / "venv" / "bin" / "fleetrun").write_text("#!/opt/venv/bin/python\n")
    os.chmod(root / "venv" / "bin" / "fleetrun", 0o755)
    written = changes(before, walk(str(root), ()))
    assert set(written) == {str(root / p) for p in ("venv/site-packages", "venv/site-packages/paddle",
                                                     "venv/site-packages/paddle/core.so", "venv/bin",
                                                     "venv/bin/fleetrun")}
    packages = packages_of(written)
    assert [p.name for p in packages] == [str(root / "venv/bin"), str(root / "venv/site-packages/paddle")]


def test_the_cli_says_why_it_cannot_split_in_one_line(tmp_path, capsys):
    source = tmp_path / "tree"
    make_install(source)
    code = main(["split", "--parts", "2", "--max-bytes", "1000", "--tree", str(source), str(tmp_path / "out")])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("layersplit: part 1 would hold") and err.count("\n") == 1
    assert (source / "nvidia" / "cudnn" / "lib" / "libcudnn.so.8").exists(), "nothing moved"
