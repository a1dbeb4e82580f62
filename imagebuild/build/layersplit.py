"""Spread what one pip install wrote over several Docker layers of bounded size.

A puller takes an image's layers side by side (downloads, and on containerd >= 1.7 the unpacking
too), but each layer as one stream: a 3 GB layer is one 3 GB gunzip. This module turns one
install into N layers. The file list is only known inside the build, so the module runs there:
`imagebuild render` writes a copy of this file at the root of the Dockerfiles' folder, the build
context of each layer that splits, and the Dockerfile's throw-away stage runs it with that stage's
own python3 (standard library only, Python 3.7 or later):

    python3 layersplit.py snapshot FILE
        before the install: the metadata of every path on the root file system, into FILE
    python3 layersplit.py split --parts N [--max-bytes B] [--package-root DIR]...
                                (--since FILE | --tree DIR [--dest DIR]) OUT
        after it: what the install wrote (every path new or changed since the snapshot, or every
        path under DIR, placed at --dest), grouped by package, partitioned into N parts, and each
        part's files moved under OUT/<i>/ (i = 1..N) at their own paths, every folder above them
        made again with its mode, owner and times

The final stage then copies each part with `COPY --from=fetch OUT/<i>/ /`: one layer per part,
together the same files, modes, owners and links as the one layer before.

The partition (pure): a package is the folder under a package root that a path lies in
(site-packages/<top>, dist-packages/<top>, or a --package-root's child); a path outside any root
belongs with its folder's other files. A package larger than the fair share (total / N, or
--max-bytes if smaller) is broken into its files (files hard-linked together stay one piece, so
the link survives the copy). Then largest first, each piece onto the smallest part so far (ties:
by name, then the lowest part), which keeps every part near total / N. Sizes are tar bytes
(a 512-byte header, the content rounded up to 512), what the uncompressed layer holds.
"""
from __future__ import annotations

import argparse
import json
import os
import stat
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from imagebuild.core.errors import ImagebuildError as _ErrorRoot
else:
    try:  # in the package, the one error root; the copy a build runs has only the standard library
        from imagebuild.core.errors import ImagebuildError as _ErrorRoot
    except ImportError:
        _ErrorRoot = Exception

TAR_BLOCK = 512
PACKAGE_FOLDERS = ("site-packages", "dist-packages")


class SplitError(_ErrorRoot):
    """The install cannot be split as asked; the message says why and what to change."""


# --- the partition (pure) -------------------------------------------------------------------


def tar_bytes(size: int) -> int:
    """What one entry of `size` content bytes takes in an uncompressed layer."""
    return TAR_BLOCK + -(-size // TAR_BLOCK) * TAR_BLOCK


@dataclass(frozen=True)
class Piece:
    """Paths that must land in one layer together: one file, or every name of a hard-linked file."""

    paths: tuple[str, ...]
    size: int


@dataclass(frozen=True)
class Package:
    name: str
    pieces: tuple[Piece, ...]

    @property
    def size(self) -> int:
        return sum(p.size for p in self.pieces)


@dataclass(frozen=True)
class Unit:
    """What the partition places: a whole package, or one piece of a package too large to keep whole."""

    name: str
    size: int
    paths: tuple[str, ...]


@dataclass(frozen=True)
class Part:
    units: tuple[Unit, ...]

    @property
    def size(self) -> int:
        return sum(u.size for u in self.units)

    @property
    def paths(self) -> tuple[str, ...]:
        return tuple(path for unit in self.units for path in unit.paths)


def package_of(path: str, roots: tuple[str, ...] = ()) -> str:
    """The package a path belongs to: the child of the innermost package root above it, else its folder."""
    parts = path.split("/")
    for i in range(len(parts) - 2, 0, -1):
        above = "/".join(parts[:i + 1])
        if (parts[i] in PACKAGE_FOLDERS or above in roots) and i + 1 < len(parts):
            return "/".join(parts[:i + 2])
    return "/".join(parts[:-1]) or "/"


def partition(packages: list[Package], parts: int, max_bytes: int | None = None) -> list[Part]:
    """`parts` parts (some empty when there is too little to share), largest unit first onto the smallest part."""
    if parts < 1:
        raise SplitError(f"parts must be at least 1, not {parts}")
    total = sum(p.size for p in packages)
    share = -(-total // parts)
    if max_bytes is not None:
        share = min(share, max_bytes)
    units: list[Unit] = []
    for package in packages:
        if package.size > share and len(package.pieces) > 1:
            units += [Unit(f"{package.name} ({piece.paths[0]})", piece.size, piece.paths) for piece in package.pieces]
        else:
            units.append(Unit(package.name, package.size, tuple(p for piece in package.pieces for p in piece.paths)))
    units.sort(key=lambda u: (-u.size, u.name))
    bins: list[list[Unit]] = [[] for _ in range(parts)]
    sizes = [0] * parts
    for unit in units:
        smallest = min(range(parts), key=lambda i: (sizes[i], i))
        bins[smallest].append(unit)
        sizes[smallest] += unit.size
    result = [Part(tuple(b)) for b in bins]
    if max_bytes is not None:
        over = [(i + 1, p) for i, p in enumerate(result) if p.size > max_bytes]
        if over:
            number, part = over[0]
            largest = part.units[0]
            raise SplitError(f"part {number} would hold {part.size:,} bytes, over the bound of {max_bytes:,} "
                             f"({total:,} bytes in {parts} parts; its largest piece: {largest.name}, "
                             f"{largest.size:,} bytes): raise pip_layers.parts or pip_layers.max_part_mib")
    return result


@dataclass(frozen=True)
class Entry:
    """What `snapshot` keeps of one path: enough to tell that an install changed it."""

    kind: str  # d (folder), f (regular file), l (symbolic link), o (anything else)
    mode: int
    uid: int
    gid: int
    size: int
    mtime_ns: int
    ctime_ns: int
    inode: int
    links: int

    def same_as(self, other: Entry) -> bool:
        # The link count moves when another name of the file comes or goes, not the file itself.
        return (self.kind, self.mode, self.uid, self.gid, self.size, self.mtime_ns, self.ctime_ns, self.inode) == \
            (other.kind, other.mode, other.uid, other.gid, other.size, other.mtime_ns, other.ctime_ns, other.inode)


def changes(before: dict[str, Entry], after: dict[str, Entry]) -> dict[str, Entry]:
    """Every path new or changed since `before`. A path that went away cannot be said by a layer that only
    adds files, so that is refused."""
    removed = sorted(set(before) - set(after))
    if removed:
        shown = ", ".join(removed[:5]) + (f" and {len(removed) - 5} more" if len(removed) > 5 else "")
        raise SplitError(f"the install removed {len(removed)} path(s) of the layer below ({shown}); a split layer "
                         "can only add files: install that package in the layer below, or set pip_layers.parts: 1")
    return {path: entry for path, entry in after.items() if path not in before or not entry.same_as(before[path])}


def packages_of(written: dict[str, Entry], roots: tuple[str, ...] = ()) -> list[Package]:
    """Group what an install wrote into packages of pieces. A folder goes in only when nothing under it was
    written (an empty one); every other folder is made again above the files it holds."""
    holds = {os.path.dirname(path) for path in written}
    by_inode: dict[int, list[str]] = {}
    pieces: list[tuple[str, ...]] = []
    for path, entry in sorted(written.items()):
        if entry.kind == "d":
            if path not in holds:
                pieces.append((path,))
        elif entry.kind == "f" and entry.links > 1:
            by_inode.setdefault(entry.inode, []).append(path)
        else:
            pieces.append((path,))
    pieces += [tuple(paths) for paths in by_inode.values()]
    grouped: dict[str, list[Piece]] = {}
    for paths in pieces:
        entry = written[paths[0]]
        size = tar_bytes(entry.size if entry.kind == "f" else 0) + TAR_BLOCK * (len(paths) - 1)
        grouped.setdefault(package_of(paths[0], roots), []).append(Piece(paths, size))
    return [Package(name, tuple(sorted(grouped[name], key=lambda p: p.paths))) for name in sorted(grouped)]


def folders_above(paths: tuple[str, ...]) -> list[str]:
    """Every folder between / and each path (not / itself), parents before children."""
    folders: set[str] = set()
    for path in paths:
        parent = os.path.dirname(path)
        while parent not in ("/", "") and parent not in folders:
            folders.add(parent)
            parent = os.path.dirname(parent)
    return sorted(folders)


def describe(parts: list[Part]) -> list[str]:
    """One line per part, for the build log."""
    lines = []
    for i, part in enumerate(parts, 1):
        names = ", ".join(u.name for u in part.units[:3]) + (f", +{len(part.units) - 3} more" if len(part.units) > 3 else "")
        lines.append(f"layersplit: part {i}: {part.size:,} bytes, {len(part.paths)} path(s): {names or 'empty'}")
    return lines


# --- the file system (effects, inside the build) --------------------------------------------


def entry_of(st: os.stat_result) -> Entry:
    mode = st.st_mode
    kind = "d" if stat.S_ISDIR(mode) else "f" if stat.S_ISREG(mode) else "l" if stat.S_ISLNK(mode) else "o"
    return Entry(kind, stat.S_IMODE(mode), st.st_uid, st.st_gid, st.st_size if kind == "f" else 0,
                 st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_nlink)


def walk(top: str, skip: tuple[str, ...]) -> dict[str, Entry]:
    """Every path under top (top itself included), on top's file system only: mounts (/proc, the build
    secrets, /etc/hosts) are not the layer's."""
    device = os.lstat(top).st_dev
    found: dict[str, Entry] = {top: entry_of(os.lstat(top))}
    folders = [top]
    while folders:
        folder = folders.pop()
        with os.scandir(folder) as it:
            for item in it:
                path = item.path
                if path in skip:
                    continue
                st = item.stat(follow_symlinks=False)
                if st.st_dev != device:
                    continue
                found[path] = entry_of(st)
                if item.is_dir(follow_symlinks=False):
                    folders.append(path)
    return found


def save_snapshot(entries: dict[str, Entry], file: str) -> None:
    rows = {path: [e.kind, e.mode, e.uid, e.gid, e.size, e.mtime_ns, e.ctime_ns, e.inode, e.links]
            for path, e in entries.items()}
    with open(file, "w", encoding="utf-8", errors="surrogateescape") as out:
        json.dump(rows, out)


def load_snapshot(file: str) -> dict[str, Entry]:
    with open(file, encoding="utf-8", errors="surrogateescape") as f:
        rows = json.load(f)
    return {path: Entry(*row) for path, row in rows.items()}


def move_part(part: Part, out: str, source_of: dict[str, str], folders: dict[str, Entry], root: Entry) -> None:
    """Move a part's paths under `out` at their place in the image (`source_of` maps an image path to where the
    install left it), making every folder above them again with the metadata in `folders`."""
    os.makedirs(out)
    made = folders_above(part.paths)
    for folder in made:
        os.mkdir(out + folder)
    for path in part.paths:
        if path in folders and not os.path.lexists(out + path):  # an empty folder of its own
            os.mkdir(out + path)
            made.append(path)
        else:
            os.rename(source_of.get(path, path), out + path)
    # Deepest first: setting a folder's times must come after everything made inside it.
    for folder in sorted(made, reverse=True):
        _restore(out + folder, folders[folder])
    _restore(out, root)


def _restore(path: str, entry: Entry) -> None:
    os.chown(path, entry.uid, entry.gid, follow_symlinks=False)
    os.chmod(path, entry.mode)
    os.utime(path, ns=(entry.mtime_ns, entry.mtime_ns), follow_symlinks=False)


def _relocate(entries: dict[str, Entry], tree: str, dest: str) -> tuple[dict[str, Entry], dict[str, str]]:
    """The tree's entries under their image paths, and where each one lies now."""
    placed: dict[str, Entry] = {}
    source_of: dict[str, str] = {}
    for path, entry in entries.items():
        image_path = dest + path[len(tree):]
        placed[image_path] = entry
        source_of[image_path] = path
    return placed, source_of


def split(args: argparse.Namespace) -> list[Part]:
    out = os.path.abspath(args.out)
    skip = (os.path.dirname(out), out)
    source_of: dict[str, str] = {}
    if args.since:
        since = os.path.abspath(args.since)
        written = changes(load_snapshot(since), walk("/", skip + (os.path.dirname(since),)))
    else:
        tree = os.path.abspath(args.tree)
        written, source_of = _relocate(walk(tree, skip), tree, os.path.abspath(args.dest or tree))
    written.pop("/", None)  # the root is every part's, and each part's own folder stands for it
    roots = tuple(os.path.abspath(r) for r in args.package_root)
    parts = partition(packages_of(written, roots), args.parts, args.max_bytes)
    # Every folder a part makes again takes the metadata the install left it, read before anything moves.
    folders = {path: entry for path, entry in written.items() if entry.kind == "d"}
    for part in parts:
        for folder in folders_above(part.paths):
            if folder not in folders:
                folders[folder] = entry_of(os.lstat(source_of.get(folder, folder)))
    root = entry_of(os.lstat("/"))
    for i, part in enumerate(parts, 1):
        move_part(part, os.path.join(out, str(i)), source_of, folders, root)
    return parts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="layersplit.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    snap = commands.add_parser("snapshot", help="record the root file system before an install")
    snap.add_argument("file")
    cut = commands.add_parser("split", help="move what the install wrote into OUT/1..N")
    cut.add_argument("--parts", type=int, required=True)
    cut.add_argument("--max-bytes", type=int)
    cut.add_argument("--package-root", action="append", default=[])
    where = cut.add_mutually_exclusive_group(required=True)
    where.add_argument("--since", help="a snapshot taken before the install")
    where.add_argument("--tree", help="a folder the install wrote")
    cut.add_argument("--dest", help="where --tree's folder lies in the image (default: where it is)")
    cut.add_argument("out")
    args = parser.parse_args(argv)
    try:
        if args.command == "snapshot":
            file = os.path.abspath(args.file)
            save_snapshot(walk("/", (os.path.dirname(file),)), file)
            return 0
        for line in describe(split(args)):
            print(line)
        return 0
    except SplitError as exc:
        print(f"layersplit: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
