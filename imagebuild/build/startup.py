"""What an image's start-up reads, recorded once inside the image: eStargz's prefetch list.

A node that mounts an eStargz image lazily fetches, before the container starts, the range of each
layer up to its prefetch landmark, and everything else on first read (oci/estargz.py). What belongs
before the landmark is what the image needs to start, and the image says that itself: its health
check, which the release layer sets to `/opt/venv/bin/python -c "import paddle"`
(templates/release.Dockerfile.j2). So the push runs that command once in the built image, under the
same confinement as the smoke tests (no network, read-only root, its own user), with a Python audit
hook recording every file Python opens (modules, bytecode, data files), and, once it is done, every
file mapped into the process (the interpreter, the dynamic loader, each shared library Paddle's
import loaded, whoever asked for it), with how many of its 4 MiB chunks (eStargz's) the process
touched, from its own page map. Each path is given with the symbolic links it went through
(Debian's `/lib64` and `/opt/venv/bin/python` are links), since a layer holds the links and their
targets as entries of their own.

What is prefetched is every file the start-up read, but for a large library it only partly touched:
Paddle's GPU `libphi.so` is 1.96 GB, of which `import paddle` touches 41 of 468 chunks (relocations,
init code), so prefetching it whole would fetch and unpack twelve times what a lazy read does. A
mapped file of more than ON_DEMAND_MIN_CHUNKS chunks with fewer than half of them touched is left to
on-demand reads (`on_demand`); the push log names each one with its counts.

An image whose health check is not a Python `-c` command gets no list: its layers start with the
no-prefetch landmark and everything is fetched on first read; the push log says why.
"""
from __future__ import annotations

import json
import posixpath
from dataclasses import dataclass, field
from typing import Any

MARK = "IMAGEBUILD-STARTUP-FILES "
MAX_PATHS = 200_000
MAX_PATH_LENGTH = 4096
TIMEOUT_S = 600
ON_DEMAND_MIN_CHUNKS = 4  # a mapped file of more chunks than this, half of them or more untouched, is read on demand

# Runs as `python -c RECORDER CODE CHUNK` inside the image: CODE is the health check's own `-c` argument,
# CHUNK eStargz's chunk size.
RECORDER = r"""
import json, os, sys
opened = []
def _hook(event, args):
    if event == "open" and args and isinstance(args[0], str):
        opened.append(args[0])
sys.addaudithook(_hook)
code, chunk = sys.argv[1], int(sys.argv[2])
sys.argv = ["-c"]
status = 0
try:
    exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})
except BaseException as exc:
    status = 1
    print(f"startup command failed: {exc!r}", file=sys.stderr)
finally:
    mapped, touched = [], {}
    page = os.sysconf("SC_PAGE_SIZE")
    try:  # an emulator (qemu-user) may not give the guest's page map: then no file counts as partly read
        pagemap = open("/proc/self/pagemap", "rb")
    except OSError:
        pagemap = None
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(None, 5)
            if len(fields) != 6 or not fields[5].startswith("/"):
                continue
            path = fields[5].strip()
            mapped.append(path)
            if pagemap is None:
                continue
            low, high = (int(x, 16) for x in fields[0].split("-"))
            try:
                pagemap.seek(low // page * 8)
                entries = pagemap.read((high - low) // page * 8)
            except OSError:
                continue
            chunks = touched.setdefault(path, set())
            for i in range(len(entries) // 8):
                if entries[i * 8 + 7] & 0x80:  # bit 63: the page is present in this process
                    chunks.add((int(fields[2], 16) + i * page) // chunk)
    def chain(path):
        # The path and every symbolic link it passes through, as separate layer entries.
        out, path = [], os.path.abspath(path)
        for _ in range(40):
            head, parts = "/", path.strip("/").split("/")
            for i, part in enumerate(parts):
                candidate = os.path.join(head, part)
                if os.path.islink(candidate):
                    out.append(candidate)
                    target = os.readlink(candidate)
                    path = os.path.normpath(os.path.join(head, target, *parts[i + 1:]))
                    break
                head = candidate
            else:
                out.append(path)
                return out
        return out
    seen, files = set(), []
    for path in [sys.executable, "/lib64/ld-linux-x86-64.so.2", "/etc/ld.so.cache", *opened, *mapped]:
        if path.startswith(("/proc/", "/sys/", "/dev/", "/tmp/")) or not os.path.lexists(path):
            continue
        for step in chain(path):
            if step not in seen and (os.path.islink(step) or os.path.isfile(step)):
                seen.add(step)
                files.append(step)
    sizes = {p: -(-os.path.getsize(p) // chunk) for p in touched if os.path.isfile(p)}
    partly = {p: [len(touched[p]), sizes[p]] for p in sizes if p in seen}
    print("IMAGEBUILD-STARTUP-FILES " + json.dumps({"files": files, "mapped": partly}), flush=True)
    sys.stdout.flush()
    os._exit(status)
"""


@dataclass(frozen=True)
class StartupCommand:
    """The health check's Python interpreter and the code it runs with `-c`."""

    python: str
    code: str


@dataclass
class Startup:
    """The files a start-up read, in the order first read, and what to say about how they were found."""

    files: list[str] = field(default_factory=list)  # to prefetch
    on_demand: dict[str, tuple[int, int]] = field(default_factory=dict)  # read only in part: (touched, chunks)
    note: str = ""


@dataclass(frozen=True)
class Recorded:
    """What the recorder printed: every file read, and for each mapped one (touched chunks, chunks)."""

    files: list[str]
    mapped: dict[str, tuple[int, int]]


def split(recorded: Recorded) -> tuple[list[str], dict[str, tuple[int, int]]]:
    """(the files to prefetch, the large mapped files touched in less than half of their chunks)."""
    first: list[str] = []
    on_demand: dict[str, tuple[int, int]] = {}
    for path in recorded.files:
        touched, chunks = recorded.mapped.get(path, (0, 0))
        if chunks > ON_DEMAND_MIN_CHUNKS and touched * 2 < chunks:
            on_demand[path] = (touched, chunks)
        else:
            first.append(path)
    return first, on_demand


def startup_command(config: dict[str, Any]) -> StartupCommand | None:
    """The image's health check when it is `["CMD", <python>, "-c", <code>]` (the release layer's)."""
    check = (config.get("Healthcheck") or config.get("healthcheck") or {}) if isinstance(config, dict) else {}
    test = check.get("Test") if isinstance(check, dict) else None
    if not isinstance(test, list) or len(test) != 4 or test[0] != "CMD" or test[2] != "-c":
        return None
    python, code = test[1], test[3]
    if not isinstance(python, str) or not isinstance(code, str) or not python.startswith("/") \
            or not posixpath.basename(python).startswith("python"):
        return None
    return StartupCommand(python, code)


def _path(path: object) -> str:
    if not isinstance(path, str) or not path.startswith("/") or "\x00" in path or len(path) > MAX_PATH_LENGTH:
        raise ValueError(f"the recorder's list holds {str(path)[:80]!r}, not an absolute path")
    return path


def parse_recorded(output: str) -> Recorded:
    """The recorder's record from the container's output: absolute paths only, each once, bounded; chunk
    counts whole numbers.

    The output is the image's, so it is checked like any input: a line that is not the recorder's
    well-formed record gives ValueError.
    """
    line = next((line for line in reversed(output.splitlines()) if line.startswith(MARK)), None)
    if line is None:
        raise ValueError("the recorder printed no list of files")
    record = json.loads(line[len(MARK):])
    files, mapped = (record.get("files"), record.get("mapped")) if isinstance(record, dict) else (None, None)
    if not isinstance(files, list) or len(files) > MAX_PATHS or not isinstance(mapped, dict) or len(mapped) > MAX_PATHS:
        raise ValueError(f"the recorder's record is not a list of at most {MAX_PATHS} paths and their chunks")
    counts: dict[str, tuple[int, int]] = {}
    for path, pair in mapped.items():
        if not isinstance(pair, list) or len(pair) != 2 or \
                not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in pair):
            raise ValueError(f"the recorder's chunk counts for {str(path)[:80]!r} are not two whole numbers")
        counts[_path(path)] = (pair[0], pair[1])
    return Recorded(list(dict.fromkeys(_path(path) for path in files)), counts)


def record(client: Any, image: str, config: dict[str, Any], chunk_size: int) -> Startup:
    """Run the image's health check once in `image` under the recorder (docker SDK `client`); `chunk_size`
    is the eStargz chunk size the touched parts of mapped files are counted in."""
    import docker.errors
    import requests

    command = startup_command(config)
    if command is None:
        return Startup(note="the image's health check is not `<python> -c <code>`: no prefetch list, "
                            "every layer starts with the no-prefetch landmark")
    container = client.containers.create(
        image, entrypoint=[command.python], command=["-c", RECORDER, command.code, str(chunk_size)],
        network_disabled=True, read_only=True, tmpfs={"/tmp": "rw,nosuid,nodev,size=512m"},
        cap_drop=["ALL"], security_opt=["no-new-privileges"], labels={"io.imagebuild.startup-record": "1"})
    try:
        container.start()
        try:
            status = container.wait(timeout=TIMEOUT_S)["StatusCode"]
        except (requests.exceptions.ReadTimeout, requests.exceptions.ConnectionError):
            container.kill()
            return Startup(note=f"recording the start-up timed out after {TIMEOUT_S} s: no prefetch list")
        output = container.logs(stdout=True, stderr=False).decode("utf-8", "replace")
        errors = container.logs(stdout=False, stderr=True).decode("utf-8", "replace")
    finally:
        try:
            container.remove(force=True)
        except docker.errors.DockerException:
            pass
    try:
        recorded = parse_recorded(output)
    except ValueError as exc:
        return Startup(note=f"recording the start-up failed ({exc}; exit {status}: {errors.strip()[-300:]}): "
                            "no prefetch list")
    first, on_demand = split(recorded)
    note = f"start-up (`{command.python} -c {command.code!r}`, the health check) read {len(recorded.files)} files"
    if on_demand:
        note += "; read on demand, not prefetched: " + ", ".join(
            f"{path} ({touched} of {chunks} chunks touched)" for path, (touched, chunks) in on_demand.items())
    if status != 0:
        note += f"; then it failed (exit {status}: {errors.strip()[-300:]}); the files it read are prefetched"
    return Startup(first, on_demand, note)
