"""What an image's start-up reads, recorded once inside the image: eStargz's prefetch list.

A node that mounts an eStargz image lazily fetches, before the container starts, the range of each
layer up to its prefetch landmark, and everything else on first read (oci/estargz.py). What belongs
before the landmark is what the image needs to start, and the image says that itself: its health
check, which the release layer sets to `/opt/venv/bin/python -c "import paddle"`
(templates/release.Dockerfile.j2). So the push runs that command once in the built image, under the
same confinement as the smoke tests (no network, read-only root, its own user), with a Python audit
hook recording every file Python opens (modules, bytecode, data files), and, once it is done, every
file mapped into the process (the interpreter, the dynamic loader, each shared library Paddle's
import loaded, whoever asked for it). Each path is given with the symbolic links it went through
(Debian's `/lib64` and `/opt/venv/bin/python` are links), since a layer holds the links and their
targets as entries of their own.

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

# Runs as `python -c RECORDER CODE` inside the image: CODE is the health check's own `-c` argument.
RECORDER = r"""
import json, os, sys
opened = []
def _hook(event, args):
    if event == "open" and args and isinstance(args[0], str):
        opened.append(args[0])
sys.addaudithook(_hook)
code = sys.argv[1]
sys.argv = ["-c"]
status = 0
try:
    exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})
except BaseException as exc:
    status = 1
    print(f"startup command failed: {exc!r}", file=sys.stderr)
finally:
    mapped = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(None, 5)
            if len(fields) == 6 and fields[5].startswith("/"):
                mapped.append(fields[5].strip())
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
    print("IMAGEBUILD-STARTUP-FILES " + json.dumps(files), flush=True)
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

    files: list[str] = field(default_factory=list)
    note: str = ""


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


def parse_files(output: str) -> list[str]:
    """The recorder's list from the container's output: absolute paths only, each once, bounded.

    The output is the image's, so it is checked like any input: a line that is not the recorder's
    well-formed list gives ValueError.
    """
    line = next((line for line in reversed(output.splitlines()) if line.startswith(MARK)), None)
    if line is None:
        raise ValueError("the recorder printed no list of files")
    files = json.loads(line[len(MARK):])
    if not isinstance(files, list) or len(files) > MAX_PATHS:
        raise ValueError(f"the recorder's list is not a list of at most {MAX_PATHS} paths")
    out: list[str] = []
    for path in files:
        if not isinstance(path, str) or not path.startswith("/") or "\x00" in path or len(path) > MAX_PATH_LENGTH:
            raise ValueError(f"the recorder's list holds {str(path)[:80]!r}, not an absolute path")
        if path not in out:
            out.append(path)
    return out


def record(client: Any, image: str, config: dict[str, Any]) -> Startup:
    """Run the image's health check once in `image` under the recorder (docker SDK `client`)."""
    import docker.errors
    import requests

    command = startup_command(config)
    if command is None:
        return Startup(note="the image's health check is not `<python> -c <code>`: no prefetch list, "
                            "every layer starts with the no-prefetch landmark")
    container = client.containers.create(
        image, entrypoint=[command.python], command=["-c", RECORDER, command.code],
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
        files = parse_files(output)
    except ValueError as exc:
        return Startup(note=f"recording the start-up failed ({exc}; exit {status}: {errors.strip()[-300:]}): "
                            "no prefetch list")
    note = f"start-up (`{command.python} -c {command.code!r}`, the health check) read {len(files)} files"
    if status != 0:
        note += f", then failed (exit {status}: {errors.strip()[-300:]}); the files it read are prefetched"
    return Startup(files, note)
