"""Benchmark: a first build of the example, from nothing, against plain `docker build` + `docker push`.

    python bench/bench_cold_build.py                          # the whole example (both variants)
    python bench/bench_cold_build.py --only device=cpu --json-out cold.json

Each side starts from an empty registry of its own (a throw-away /usr/bin/docker-registry on
a free 127.0.0.1 port, holding only a copy of the base image) and an empty BuildKit cache
(`docker builder prune -af`, and every image of both throw-away registries removed), then
builds the same rendered Dockerfiles with the same build args and secrets:

  imagebuild  `imagebuild build --jobs 2` on a copy of the matrix pointing at its registry;
              layers pushed by imagebuild/build/publish.py.
  peer        for each layer, parents first, at most 2 at once: `docker build --platform` (BuildKit,
              FROM the parent by the digest its push printed) and `docker push`; then, for each
              variant of several platforms, its OCI index by hand (`crane index append` of every
              platform's release image), as a team without buildx would.

    python bench/bench_cold_build.py --only id=paddle3.2.2-cpu-py3.11-debian12   # two platforms

Prints per side the wall time and where it went (per layer: build_s, push_s, and for
imagebuild export_s, compress_s, upload_s), the ratio peer/imagebuild, and the same as JSON
on stdout's last line (and in --json-out). Exits 1 when a side fails or the ratio is below
--target. `docker builder prune` empties the BuildKit cache that everyone on this engine
shares; the package downloads go to the network each time, so figures move with its speed
and with whatever else runs on the machine: the load average is in the output.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import docker
import httpx
import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from imagebuild.build.plan import Variant  # noqa: E402
from imagebuild.build.publish import pushed_digest  # noqa: E402
from imagebuild.build.scheduler import git_revision, prepare  # noqa: E402
from imagebuild.config.matrix import load_matrix  # noqa: E402
from imagebuild.config.selection import Selection  # noqa: E402
from imagebuild.core.runner import docker_cli  # noqa: E402

REGISTRY_BIN = "/usr/bin/docker-registry"
CRANE = "/opt/imagebuild-tools/bin/crane"
CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"


class ThrowAwayRegistry:
    """A registry of our own (as scripts/bootstrap.sh configures them), storage in a temp dir."""

    def __init__(self, scratch: Path, name: str, access_log: bool = False):
        self.dir = scratch / f"registry-{name}"
        (self.dir / "storage").mkdir(parents=True)
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.host = f"127.0.0.1:{self.port}"
        config = {
            "version": 0.1,
            # access_log: a "response completed" line per request, with the bytes it wrote (served_bytes).
            "log": {"level": "info" if access_log else "warn", "accesslog": {"disabled": True}},
            "storage": {"filesystem": {"rootdirectory": str(self.dir / "storage")},
                        "delete": {"enabled": True}, "cache": {"blobdescriptor": "inmemory"}},
            "http": {"addr": self.host},
        }
        (self.dir / "config.yml").write_text(yaml.safe_dump(config))
        self.log = (self.dir / "registry.log").open("w")
        self.process = subprocess.Popen([REGISTRY_BIN, "serve", str(self.dir / "config.yml")],
                                        stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        for _ in range(100):
            try:
                if httpx.get(f"http://{self.host}/v2/", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.process.poll() is not None:
                break
            time.sleep(0.1)
        self.stop()
        sys.exit(f"the throw-away registry did not start; see {self.dir / 'registry.log'}")

    def served_bytes(self) -> int:
        """Response bytes of the requests completed so far (a registry started with access_log=True)."""
        self.log.flush()
        text = (self.dir / "registry.log").read_text(errors="replace")
        return sum(int(m.group(1)) for m in re.finditer(r"http\.response\.written=(\d+)", text))

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=30)
        self.log.close()


def sh(*cmd: str, timeout: float = 3600) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)


def matrix_for(source: Path, registry: str, base: str, scratch: Path, name: str) -> Path:
    """A copy of the matrix whose registry and base image are the throw-away registry's; rendered."""
    data = yaml.safe_load(source.read_text())
    data["registry"] = registry
    for spec in data.get("os", {}).values():
        spec["image"] = f"{registry}/{base.split('/', 1)[1]}"
        spec.pop("digest", None)
    directory = scratch / f"matrix-{name}"
    directory.mkdir()
    target = directory / "matrix.yaml"
    target.write_text(yaml.safe_dump(data, sort_keys=False))
    render = subprocess.run([sys.executable, "-m", "imagebuild", "render", "--matrix", str(target)],
                            capture_output=True, text=True, cwd=REPO, check=False)
    if render.returncode != 0:
        sys.exit(f"render failed:\n{render.stderr}")
    copy = sh(CRANE, "copy", "--insecure", base, f"{registry}/{base.split('/', 1)[1]}")
    if copy.returncode != 0:
        sys.exit(f"copying the base image failed:\n{copy.stderr}")
    return target


def make_cold(client: docker.DockerClient, registries: list[str], prune: bool = True) -> None:
    """Empty BuildKit cache; no image of either side's registry left in the engine."""
    for image in client.images.list(all=True):
        names = image.attrs.get("RepoTags", []) + image.attrs.get("RepoDigests", [])
        if any(name.startswith(f"{r}/") for r in registries for name in names):
            client.images.remove(image.id, force=True)
    if not prune:
        return
    pruned = sh(docker_cli(), "builder", "prune", "-af")
    if pruned.returncode != 0:
        sys.exit(f"docker builder prune failed:\n{pruned.stderr}")


def run_imagebuild(matrix: Path, only: list[str], jobs: int, scratch: Path) -> dict:
    workdir = scratch / "workdir-imagebuild"
    cmd = [sys.executable, "-m", "imagebuild", "build", "--matrix", str(matrix), "--workdir", str(workdir),
           "--jobs", str(jobs), "--secret", f"ca-bundle={CA_BUNDLE}"]
    for selector in only:
        cmd += ["--only", selector]
    started = time.monotonic()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=None, text=True, cwd=REPO, check=False,
                          env={k: v for k, v in os.environ.items() if k != "IMAGEBUILD_NETRC"})  # progress: stderr
    total = time.monotonic() - started
    report = json.loads((workdir / "build-report.json").read_text())
    layers = [{"path": rec["path"], "platform": rec.get("platform", ""), "digest": rec["digest"], "status": rec["status"], **(rec.get("steps") or {}),
               "blobs": rec.get("blobs"), "pushed_by": rec.get("pushed_by")} for rec in report["layers"]]
    return {"ok": proc.returncode == 0, "total_s": round(total, 1), "layers": layers,
            "error": None if proc.returncode == 0 else proc.stdout[-3000:]}


def run_peer(matrix: Path, only: list[str], jobs: int, scratch: Path) -> dict:
    """`docker build` + `docker push` per layer, parents first, `jobs` at once, as imagebuild schedules."""
    docker = docker_cli()
    revision, created = git_revision(REPO)
    plan = prepare(load_matrix(matrix), revision, created)
    keys = list(dict.fromkeys(k for v in Selection.parse(only).apply(plan.variants) for k in v.chain))
    dockerfiles = matrix.parent / "dockerfiles"
    logs = scratch / "logs-peer"
    logs.mkdir()
    futures: dict[str, Future] = {}
    lock = threading.Lock()
    layers: list[dict] = []

    def one(key: str) -> str:
        layer = plan.layers[key]
        args = dict(layer.build_args)
        if layer.parent is not None:
            args["IMAGEBUILD_PARENT"] = f"{plan.cache_ref}@{futures[layer.parent].result()}"
        image = f"{plan.cache_ref}:{layer.cache_tag}"
        cmd = [docker, "build", "--progress=plain", "--platform", layer.platform,
               "--label", f"io.imagebuild.layer.key={key}", "-t", image]
        for name, value in sorted(args.items()):
            cmd += ["--build-arg", f"{name}={value}"]
        # A layer that reads a file shared with others (the layer split's program) builds from the tree's root.
        if layer.shared:
            cmd += ["--file", str(dockerfiles / layer.path / "Dockerfile")]
        cmd += ["--secret", f"id=ca-bundle,src={CA_BUNDLE}", str(dockerfiles if layer.shared else dockerfiles / layer.path)]
        started = time.monotonic()
        build = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "DOCKER_BUILDKIT": "1"},
                               check=False)
        built = time.monotonic()
        (logs / f"{layer.kind}-{key[:12]}.log").write_text(build.stdout + build.stderr)
        if build.returncode != 0:
            raise RuntimeError(f"docker build {layer.path} failed:\n{build.stderr[-2000:]}")
        push = subprocess.run([docker, "push", image], capture_output=True, text=True, check=False)
        digest = pushed_digest(push.stdout) if push.returncode == 0 else None
        if not digest:
            raise RuntimeError(f"docker push {image} failed:\n{push.stdout[-1000:]}{push.stderr[-1000:]}")
        with lock:
            layers.append({"path": layer.path, "platform": layer.platform, "digest": digest, "status": "built",
                           "build_s": round(built - started, 1), "push_s": round(time.monotonic() - built, 1)})
            print(f"[peer] {layers[-1]}", file=sys.stderr, flush=True)
        return digest

    started = time.monotonic()
    error = None
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for key in keys:  # the plan's order puts parents first, so a waiting child never starves its parent
            futures[key] = pool.submit(one, key)
        for future in futures.values():
            try:
                future.result()
            except RuntimeError as exc:
                error = error or str(exc)
    for variant in Selection.parse(only).apply(plan.variants):
        if error is None and variant.multi_platform:
            error = peer_index(plan.repository_ref, variant, {p.platform: futures[p.chain[-1]].result()
                                                          for p in variant.platform_chains}, plan.cache_ref, layers)
    return {"ok": error is None, "total_s": round(time.monotonic() - started, 1), "layers": layers, "error": error}


def peer_index(repository: str, variant: Variant, children: dict[str, str], cache_ref: str,
               layers: list[dict]) -> str | None:
    """The variant's index by hand: `crane index append` of each platform's release image, under its tag."""
    started = time.monotonic()
    manifests = [arg for digest in children.values() for arg in ("-m", f"{cache_ref}@{digest}")]
    made = sh(CRANE, "index", "append", "--insecure", *manifests, "-t", f"{repository}:{variant.tags[0]}")
    if made.returncode != 0:
        return f"crane index append failed:\n{made.stderr[-2000:]}"
    layers.append({"path": f"index/{variant.id}", "platform": ",".join(children), "status": "built",
                   "index_s": round(time.monotonic() - started, 1)})
    return None


def sums(side: dict) -> dict[str, float]:
    totals: dict[str, float] = {}
    for layer in side["layers"]:
        for name, value in layer.items():
            if name.endswith("_s") and isinstance(value, (int, float)):
                totals[name] = round(totals.get(name, 0.0) + value, 1)
    return totals


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--matrix", type=Path, default=REPO / "examples" / "local" / "matrix.yaml")
    parser.add_argument("--base", default="127.0.0.1:5000/imagebuild/debian:12",
                        help="the base image, copied into each throw-away registry")
    parser.add_argument("--only", action="append", default=[], help="as imagebuild build --only")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--sides", default="imagebuild,peer", help="which sides, in this order")
    parser.add_argument("--target", type=float, default=1.5, help="the least peer/imagebuild ratio allowed")
    parser.add_argument("--json-out", type=Path)
    parser.add_argument("--keep-cache", action="store_true",
                        help="skip `docker builder prune` (not a cold build: for trying the script out)")
    args = parser.parse_args()

    client = docker.from_env(timeout=600)
    runners = {"imagebuild": run_imagebuild, "peer": run_peer}
    sides = [s for s in args.sides.split(",") if s]
    result: dict = {"matrix": str(args.matrix), "only": args.only, "jobs": args.jobs, "cores": os.cpu_count(),
                    "cold": not args.keep_cache, "sides": {}}
    with tempfile.TemporaryDirectory(prefix="bench-cold-") as tmp:
        scratch = Path(tmp)
        registries = {side: ThrowAwayRegistry(scratch, side) for side in sides}
        try:
            matrices = {side: matrix_for(args.matrix, registries[side].host, args.base, scratch, side)
                        for side in sides}
            for side in sides:
                make_cold(client, [r.host for r in registries.values()], prune=not args.keep_cache)
                load = os.getloadavg()[0]
                print(f"[{side}] cold start (load average {load:.1f}) ...", file=sys.stderr, flush=True)
                outcome = runners[side](matrices[side], args.only, args.jobs, scratch)
                outcome["sum"] = sums(outcome)
                outcome["load_before"] = round(load, 1)
                outcome["load_after"] = round(os.getloadavg()[0], 1)
                result["sides"][side] = outcome
                print(f"[{side}] {'ok' if outcome['ok'] else 'FAILED'} in {outcome['total_s']} s; "
                      f"sums {outcome['sum']}", file=sys.stderr, flush=True)
                if args.json_out:
                    args.json_out.write_text(json.dumps(result, indent=2) + "\n")
            make_cold(client, [r.host for r in registries.values()], prune=False)  # leave no images behind
        finally:
            for registry in registries.values():
                registry.stop()
            shutil.rmtree(scratch, ignore_errors=True)

    ok = all(side["ok"] for side in result["sides"].values())
    if {"imagebuild", "peer"} <= set(result["sides"]) and ok:
        result["ratio"] = round(result["sides"]["peer"]["total_s"] / result["sides"]["imagebuild"]["total_s"], 2)
    for name, side in result["sides"].items():
        print(f"\n{name}: {'ok' if side['ok'] else 'FAILED'}, {side['total_s']} s wall "
              f"(load average {side['load_before']} -> {side['load_after']})")
        for layer in side["layers"]:
            steps = "  ".join(f"{k.removesuffix('_s')} {v}" for k, v in layer.items() if k.endswith("_s"))
            by = f"  ({layer['pushed_by']})" if layer.get("pushed_by") else ""
            print(f"  {layer['path'] + ' ' + layer.get('platform', ''):62} {steps}{by}")
        print(f"  {'sum over layers':62} " + "  ".join(f"{k.removesuffix('_s')} {v}" for k, v in side["sum"].items()))
        if side["error"]:
            print(f"  error: {side['error']}")
    if "ratio" in result:
        print(f"\npeer / imagebuild: {result['ratio']}x (target {args.target}x)")
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    return 0 if ok and result.get("ratio", 0) >= args.target else 1


if __name__ == "__main__":
    sys.exit(main())
