"""Benchmark: scripts/bootstrap.sh as on a fresh machine, beside the working installation.

    sudo python3 bench/bench_bootstrap.py            # root: bootstrap installs and starts things
    sudo python3 bench/bench_bootstrap.py --keep     # keep the temporary folders for a look

Everything bootstrap builds goes to a new temporary folder (IMAGEBUILD_TOOLS_DIR, _STATE_DIR,
_LOG_DIR, _RUN_DIR), with empty Go module and build caches (GOMODCACHE, GOCACHE), and the
base image under a repository of its own (IMAGEBUILD_BASE_REPO), so cosign, crane and
actionlint compile from nothing, Trivy and the venv install from PyPI, and the base image is
built and pushed again. What this machine already has is not redone and not measured: apt
packages, a running dockerd and the registries (on a bare machine those add about half a
minute, and overlap the Go builds, which start first).

Prints bootstrap's own lines with their time stamps, each Go tool's build time, and the total.
Exits 1 when bootstrap failed.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder")
    parser.add_argument("--script", type=Path, default=REPO / "scripts" / "bootstrap.sh",
                        help="another checkout's bootstrap.sh (its versions.env must honour the same variables)")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("run as root: bootstrap installs packages and starts services", file=sys.stderr)
        return 2
    root = Path(tempfile.mkdtemp(prefix="imagebuild-bench-bootstrap-"))
    env = {**os.environ,
           "IMAGEBUILD_TOOLS_DIR": str(root / "tools"), "IMAGEBUILD_STATE_DIR": str(root / "state"),
           "IMAGEBUILD_LOG_DIR": str(root / "log"), "IMAGEBUILD_RUN_DIR": str(root / "run"),
           "GOMODCACHE": str(root / "gomodcache"), "GOCACHE": str(root / "gocache"),
           "IMAGEBUILD_BASE_REPO": f"imagebuild-bench/debian-{uuid.uuid4().hex[:8]}"}
    started = time.monotonic()
    proc = subprocess.Popen([str(args.script)], cwd=args.script.parent.parent, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert proc.stdout is not None
    built: dict[str, str] = {}
    for line in proc.stdout:
        print(f"{time.monotonic() - started:7.1f}s | {line}", end="")
        match = re.search(r"(\w+): built in (\d+)s", line)
        if match:
            built[match.group(1)] = match.group(2)
    code = proc.wait()
    total = time.monotonic() - started
    print()
    for tool, seconds in built.items():
        print(f"{tool:<12} built in {seconds}s")
    print(f"bootstrap from nothing (Go caches, tools, venvs, base image): {total:.0f}s, exit {code}")
    # Go's module cache is read-only on disk; make it removable.
    if not args.keep:
        subprocess.run(["chmod", "-R", "u+w", str(root)], check=False)
        shutil.rmtree(root, ignore_errors=True)
    else:
        print(f"kept: {root}")
    return 0 if code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
