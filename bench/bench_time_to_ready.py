"""Benchmark: how long a fresh node waits before a container of the image can start.

    python bench/bench_time_to_ready.py                       # the example's GPU and CPU images, eu-west
    python bench/bench_time_to_ready.py --channels cpu --runs 3 --json-out ttr.json
    python bench/bench_time_to_ready.py --no-peer --docker-pull
    python bench/bench_time_to_ready.py --compression estargz     # lazy pulling, side by side with gzip and the peer

"Ready" is what a kubelet waits for before it can start the container: every layer fetched,
decompressed and unpacked into the snapshotter, and the container's root file system prepared
on top. Each pull goes into a containerd of its own (Debian's containerd 1.6, the one the
nodes run: a fresh --root and --state in a temp dir, its own socket, the CRI plugin off, so
nothing is cached and nothing is shared with the engine's containerd), through `ctr`:

  pull      `ctr images pull --plain-http` (fetch, decompress, unpack into overlayfs; the
            default of 3 concurrent downloads, as the kubelet's)
  rootfs    `ctr containers create` (the container's snapshot prepared on the image's)

and reports the seconds of each, the bytes fetched (the content store's blobs: manifests,
config and compressed layers) and the bytes unpacked (the snapshots' apparent size). Then the
first workload: `ctr run` of the image's Python running WORKLOAD (`import paddle` and a small
matrix product, through runc on the prepared root file system), timed to its exit.

Side by side, for each image:

  imagebuild  the channel's image in the region registry (what scripts/example.sh rolled out)
  peer        the same rendered Dockerfiles built with plain `docker build` and pushed with
              `docker push` (bench_cold_build's peer: parents first, FROM each parent by
              digest) into a throw-away registry of its own on loopback, pulled the same way
  docker      (--docker-pull) `docker pull` of the imagebuild image into a Docker engine with
              an empty --data-root of its own, for sites whose nodes run Docker
  split       (--split CHANNEL=REF) another build of the channel's image, e.g. with its pip layers split into
              parts (pip_layers in the matrix), pulled the same way; with --docker-pull, by docker pull too
  c2-*        (--containerd2 N) the imagebuild and split sides pulled again by a containerd 2.x node
              (scripts/build-test-tools.sh builds it: IMAGEBUILD_WITH_CONTAINERD2=1), whose ctr pulls through
              the transfer service: layers unpacked as they arrive, N at once (max_concurrent_unpacks)
  zstd        (--compression zstd[:level]) the same image (the engine's copy of its config and
              layers) pushed again by imagebuild's publish with zstd layers under an OCI
              manifest, into a throw-away registry of its own on loopback, pulled the same way
              (the publish's seconds are printed too); Docker 20.10 cannot pull it
  estargz     (--compression estargz) the same image pushed again by publish as eStargz (its
              start-up recorded from its health check, each layer's prefetch landmark after
              it) into a throw-away registry, pulled LAZILY by a node with the stargz
              snapshotter (tests/e2e/nodes.py, lazy=True): `stargz-rpull` (the snapshotter
              mounts each layer over FUSE, fetching its TOC), `ctr containers create
              --snapshotter stargz` (waits for each layer's prefetch), then the workload, whose
              reads fetch what was not prefetched. Bytes fetched are the registry's own count
              of response bytes, at ready and at the workload's end; the snapshotter's
              background fetch of the rest (its default) goes on behind both, so the workload
              figure is the one a user feels. --background-fetch off|both adds the side
              `estargz-ondemand`: the same with background fetch off (only what is read)

The republished sides run first, and their registry is emptied before the full pulls, so the
run needs the disk of one side at a time (the GPU image's full pull: about 10 GB).

The peer's builds reuse the engine's BuildKit cache (the figure is the pull, not the build),
but its push compresses every layer again. The registries read blobs through the page cache:
run with --drop-caches (root) to empty it before each pull. On a shared 2-core machine the
decompression competes with whatever else runs: the load average is in the output. Prints a
table, the ratio peer/imagebuild per image, and the same as JSON on stdout's last line.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "bench"
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(BENCH))
import docker  # noqa: E402
from bench_cold_build import ThrowAwayRegistry, make_cold, matrix_for, run_peer, sh  # noqa: E402

from imagebuild.build.publish import publish  # noqa: E402
from imagebuild.core.runner import docker_cli  # noqa: E402
from imagebuild.oci.client import INDEX_TYPES, ImageRef, Registry  # noqa: E402
from imagebuild.oci.compression import Compression, parse_compression  # noqa: E402
from tests.e2e.nodes import CONTAINERD, CTR, STARGZ, STARGZ_GRPC, STARGZ_RPULL, ContainerdNode, unmount_below  # noqa: E402

DOCKERD = "/usr/sbin/dockerd"
CONTAINERD2 = "/opt/imagebuild-tools/bin/containerd2"
CTR2 = "/opt/imagebuild-tools/bin/ctr2"
NAMESPACE = "ttr"
PYTHON = "/opt/venv/bin/python"  # the example images' interpreter (their health check's)
WORKLOAD = "import paddle; x = paddle.rand([256, 256]); print(float((x @ x).sum()))"


@dataclass
class Pull:
    """One pull into a fresh store: where the time went and how many bytes it moved."""

    image: str
    side: str
    ref: str
    pull_s: float
    rootfs_s: float
    fetched_bytes: int  # by the time the root file system was ready
    unpacked_bytes: int
    layers: int
    load_before: float
    layer_blobs: list[int] = field(default_factory=list)  # each layer's compressed bytes, as the manifest says
    layer_bytes: list[int] = field(default_factory=list)  # each layer's unpacked bytes (containerd's snapshots)
    workload_s: float | None = None  # the first workload's run, after ready
    fetched_by_workload_bytes: int | None = None  # by the time it ended (lazy: its reads, and background fetch)
    lazy: bool = False

    @property
    def ready_s(self) -> float:
        return round(self.pull_s + self.rootfs_s, 1)

    @property
    def done_s(self) -> float | None:
        """Ready, then the first workload: what a user waits for."""
        return None if self.workload_s is None else round(self.ready_s + self.workload_s, 1)


def tree_bytes(root: Path) -> int:
    """Apparent size of every regular file under root (hard links once)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for directory, _, files in os.walk(root):
        for name in files:
            stat = os.lstat(os.path.join(directory, name))
            if (stat.st_dev, stat.st_ino) in seen or not os.path.isfile(os.path.join(directory, name)):
                continue
            seen.add((stat.st_dev, stat.st_ino))
            total += stat.st_size
    return total


def layer_blob_sizes(ref: str) -> list[int]:
    """Each layer's compressed size, in the image's order, from its manifest (linux/amd64 of an index)."""
    image = ImageRef.parse(ref)
    with Registry(image.registry) as registry:
        raw, media_type, _ = registry.get_manifest(image.repository, image.reference)
        if media_type in INDEX_TYPES:
            [child] = [m["digest"] for m in json.loads(raw)["manifests"]
                       if m.get("platform", {}).get("architecture") == "amd64"]
            raw, _, _ = registry.get_manifest(image.repository, child)
    return [int(layer["size"]) for layer in json.loads(raw)["layers"]]


def snapshot_sizes(snapshots: Path, layers: int) -> list[int]:
    """Each layer's unpacked bytes: containerd numbers its snapshots in the order it unpacks the layers."""
    folders = sorted((d for d in snapshots.iterdir() if d.name.isdigit()), key=lambda d: int(d.name))
    return [tree_bytes(d / "fs") for d in folders[:layers]]


def wait_for(path: Path, process: subprocess.Popen, what: str, log: Path) -> None:
    for _ in range(300):
        if path.exists():
            return
        if process.poll() is not None:
            break
        time.sleep(0.1)
    sys.exit(f"{what} did not start; see {log}:\n{log.read_text()[-2000:]}")


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def run_workload(store: ContainerdNode, ref: str, side: str, workload: list[str] | None,
                 snapshotter: str | None = None) -> float | None:
    """`ctr run` of the workload in a container of its own on the pulled image; its seconds to exit."""
    if not workload:
        return None
    extra = ["--snapshotter", snapshotter] if snapshotter else []
    started = time.monotonic()
    ran = store.ctr("run", "--rm", *extra, ref, f"ttr-run-{side}", *workload, namespace=NAMESPACE)
    if ran.returncode != 0:
        sys.exit(f"ctr run {ref} {shlex.join(workload)} failed:\n{ran.stdout[-1000:]}{ran.stderr[-2000:]}")
    return round(time.monotonic() - started, 1)


def pull_into_containerd(scratch: Path, image: str, side: str, ref: str, drop: bool,
                         workload: list[str] | None = None, unpacks: int = 0) -> Pull:
    """With `unpacks`, the node is a containerd 2.x that unpacks that many layers at once."""
    store = ContainerdNode(scratch, "ttr") if not unpacks else ContainerdNode(
        scratch, "ttr2", binary=CONTAINERD2, client=CTR2,
        settings=('[plugins."io.containerd.transfer.v1.local"]', f"  max_concurrent_unpacks = {unpacks}"))
    try:
        if drop:
            drop_caches()
        load = os.getloadavg()[0]
        started = time.monotonic()
        pulled = store.ctr("images", "pull", "--plain-http", ref, namespace=NAMESPACE)
        pulled_at = time.monotonic()
        if pulled.returncode != 0:
            sys.exit(f"ctr pull {ref} failed:\n{pulled.stderr[-2000:]}")
        made = store.ctr("containers", "create", ref, f"ttr-{side}", namespace=NAMESPACE)
        if made.returncode != 0:
            sys.exit(f"ctr containers create {ref} failed:\n{made.stderr[-2000:]}")
        ready_at = time.monotonic()
        blobs = store.root / "io.containerd.content.v1.content" / "blobs"
        snapshots = store.root / "io.containerd.snapshotter.v1.overlayfs" / "snapshots"
        layers = store.ctr("snapshots", "ls", namespace=NAMESPACE).stdout.count("Committed")
        unpacked = tree_bytes(snapshots)
        workload_s = run_workload(store, ref, side, workload)
        fetched = tree_bytes(blobs)
        return Pull(image=image, side=side, ref=ref, pull_s=round(pulled_at - started, 1),
                    rootfs_s=round(ready_at - pulled_at, 2), fetched_bytes=fetched,
                    unpacked_bytes=unpacked, layers=layers, load_before=round(load, 1), workload_s=workload_s,
                    fetched_by_workload_bytes=fetched if workload else None,
                    layer_blobs=layer_blob_sizes(ref), layer_bytes=snapshot_sizes(snapshots, layers))
    finally:
        store.stop()


def pull_lazily(scratch: Path, image: str, side: str, ref: str, registry: ThrowAwayRegistry, drop: bool,
                workload: list[str] | None, background_fetch: bool) -> Pull:
    """A node with the stargz snapshotter: rpull (the layers mounted over FUSE), the container's root file
    system prepared (each layer's prefetch waited for), then the workload reading through FUSE."""
    store = ContainerdNode(scratch, "ttr-lazy", lazy=True, background_fetch=background_fetch)
    try:
        if drop:
            drop_caches()
        load = os.getloadavg()[0]
        before = registry.served_bytes()
        started = time.monotonic()
        pulled = store.rpull(ref, namespace=NAMESPACE)
        pulled_at = time.monotonic()
        if pulled.returncode != 0:
            sys.exit(f"stargz-rpull {ref} failed:\n{pulled.stderr[-2000:]}")
        made = store.ctr("containers", "create", "--snapshotter", STARGZ, ref, f"ttr-{side}", namespace=NAMESPACE)
        if made.returncode != 0:
            sys.exit(f"ctr containers create {ref} failed:\n{made.stderr[-2000:]}")
        ready_at = time.monotonic()
        at_ready = registry.served_bytes() - before
        layers = len(store.fuse_mounts())
        workload_s = run_workload(store, ref, side, workload, STARGZ)
        return Pull(image=image, side=side, ref=ref, pull_s=round(pulled_at - started, 1),
                    rootfs_s=round(ready_at - pulled_at, 2), fetched_bytes=at_ready, unpacked_bytes=0,
                    layers=layers, load_before=round(load, 1), workload_s=workload_s,
                    fetched_by_workload_bytes=registry.served_bytes() - before if workload else None, lazy=True)
    finally:
        store.stop()


def pull_into_docker(scratch: Path, image: str, ref: str, drop: bool, side: str = "docker") -> Pull:
    """`docker pull` into an engine with an empty data root (its own containerd, socket and exec root)."""
    directory = Path(tempfile.mkdtemp(prefix="dockerd-", dir=scratch))
    socket = directory / "docker.sock"
    log = directory / "dockerd.log"
    # A bridge of its own: a dockerd started with `--bridge none` deletes docker0, which the
    # machine's own engine needs for every build's RUN step.
    bridge = f"ttr{os.getpid() % 100000}"
    made_bridge = sh("ip", "link", "add", bridge, "type", "bridge")
    if made_bridge.returncode != 0:
        sys.exit(f"ip link add {bridge} type bridge failed (root needed):\n{made_bridge.stderr}")
    with log.open("w") as out:
        process = subprocess.Popen(
            [DOCKERD, "--data-root", str(directory / "data"), "--exec-root", str(directory / "exec"),
             "--pidfile", str(directory / "docker.pid"), "--host", f"unix://{socket}", "--bridge", bridge,
             "--iptables=false", "--ip-masq=false", "--containerd-namespace", "ttr-docker",
             "--containerd-plugins-namespace", "ttr-docker-plugins"],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(socket, process, "dockerd", log)
        client = ["docker", "--host", f"unix://{socket}"]
        for _ in range(100):
            if sh(*client, "version").returncode == 0:
                break
            time.sleep(0.2)
        if drop:
            drop_caches()
        load = os.getloadavg()[0]
        started = time.monotonic()
        pulled = sh(*client, "pull", "--quiet", ref)
        pulled_at = time.monotonic()
        if pulled.returncode != 0:
            sys.exit(f"docker pull {ref} failed:\n{pulled.stderr[-2000:]}")
        made = sh(*client, "create", ref)
        if made.returncode != 0:
            sys.exit(f"docker create {ref} failed:\n{made.stderr[-2000:]}")
        ready_at = time.monotonic()
        [inspected] = json.loads(sh(*client, "image", "inspect", ref).stdout)
        return Pull(image=image, side=side, ref=ref, pull_s=round(pulled_at - started, 1),
                    rootfs_s=round(ready_at - pulled_at, 2), fetched_bytes=0, unpacked_bytes=inspected["Size"],
                    layers=len(inspected["RootFS"]["Layers"]), load_before=round(load, 1))
    finally:
        if process.poll() is None:
            process.terminate()
            process.wait(timeout=120)
        unmount_below(directory)
        sh("ip", "link", "delete", bridge)
        shutil.rmtree(directory, ignore_errors=True)


def channel_variants(report: Path, channels: list[str]) -> dict[str, str]:
    """channel -> variant id, as scripts/example.sh assigns them (several platforms: multiarch)."""
    found: dict[str, str] = {}
    for variant in json.loads(report.read_text())["variants"]:
        channel = "multiarch" if len(variant.get("platforms") or []) > 1 else variant["device"]
        if channel in channels and variant.get("image"):
            found.setdefault(channel, variant["id"])
    missing = [c for c in channels if c not in found]
    if missing:
        sys.exit(f"{report}: no released variant for channel(s) {', '.join(missing)}; run scripts/example.sh")
    return found


def peer_images(matrix: Path, base: str, variants: dict[str, str], scratch: Path) -> tuple[ThrowAwayRegistry, dict[str, str]]:
    """Plain docker build + docker push of each variant's chain; channel -> the release image by digest."""
    registry = ThrowAwayRegistry(scratch, "ttr-peer")
    copy = matrix_for(matrix, registry.host, base, scratch, "ttr-peer")
    only = [f"id={v}" for v in variants.values()]
    print(f"[peer] docker build + docker push of {', '.join(variants.values())} ...", file=sys.stderr, flush=True)
    outcome = run_peer(copy, only, 2, scratch)
    if not outcome["ok"]:
        registry.stop()
        sys.exit(f"the peer build failed:\n{outcome['error']}")
    data = yaml.safe_load(copy.read_text())
    cache = f"{registry.host}/{data['project']}/{data.get('cache_repository', 'layers')}"
    refs = {}
    for channel, variant in variants.items():
        release = [layer for layer in outcome["layers"] if layer["path"] == f"release/{variant}"
                   and layer.get("platform", "linux/amd64") == "linux/amd64"]
        refs[channel] = f"{cache}@{release[0]['digest']}"
    return registry, refs


def republished_images(region: str, repository: str, channels: list[str], compression: Compression,
                       scratch: Path) -> tuple[ThrowAwayRegistry, dict[str, str]]:
    """Each channel's region image pushed again as zstd or eStargz into a throw-away registry; channel -> its
    ref by digest.

    The bytes are the engine's own copy of the image (the config the region's manifest names, so
    the same diff_ids), read and compressed by imagebuild's publish, every layer new to the registry
    (eStargz: the start-up recorded in the image first, as a release push does).
    """
    side = compression.algorithm
    engine = docker.from_env(timeout=600)
    sources: dict[str, str] = {}
    with Registry(region) as registry:
        for channel in channels:
            raw, media_type, _ = registry.get_manifest(repository, channel)
            if media_type in INDEX_TYPES:
                print(f"[{side}] {channel}: an index; skipped", file=sys.stderr)
                continue
            config = json.loads(raw)["config"]["digest"]
            try:
                sources[channel] = engine.images.get(config).id
            except docker.errors.ImageNotFound:
                sys.exit(f"{region}/{repository}:{channel}: the engine holds no image of config {config} "
                         "(run scripts/example.sh on this host)")
    target = ThrowAwayRegistry(scratch, f"ttr-{side}", access_log=compression.is_estargz)
    refs = {}
    for channel, image in sources.items():
        started = time.monotonic()
        try:
            pushed = publish(image, ImageRef.parse(f"{target.host}/bench/{side}:{channel}"), None, spool=scratch,
                             compression=compression)
        except BaseException:
            target.stop()  # the caller never gets it to stop
            raise
        prefetch = ""
        if pushed.prefetch is not None:
            layers = pushed.prefetch.get("layers") or []
            prefetch = (f"; start-up read {pushed.prefetch['files']} files, {sum(x['prioritized'] for x in layers)} "
                        f"entries prioritized, {sum(x['prefetch_bytes'] for x in layers) / 1e9:.3f} GB to prefetch")
        print(f"[{side}] {channel}: published as {compression.spec} in {time.monotonic() - started:.1f} s "
              f"({pushed.uploaded_bytes / 1e9:.3f} GB of blobs; {pushed.steps}{prefetch})", file=sys.stderr, flush=True)
        refs[channel] = f"{target.host}/bench/{side}@{pushed.digest}"
    return target, refs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--region-registry", default="127.0.0.1:5001", help="the region the node pulls from")
    parser.add_argument("--repository", default="imagebuild-example/paddle")
    parser.add_argument("--channels", default="gpu,cpu", help="the channel tags to pull, in this order")
    parser.add_argument("--report", type=Path, default=REPO / ".imagebuild" / "example" / "build-report.json",
                        help="the example's build report (which variant each channel holds, for the peer)")
    parser.add_argument("--matrix", type=Path, default=REPO / "examples" / "local" / "matrix.yaml")
    parser.add_argument("--base", default="127.0.0.1:5000/imagebuild/debian:12")
    parser.add_argument("--runs", type=int, default=1, help="pulls per image and side (the median is reported)")
    parser.add_argument("--no-peer", action="store_true", help="skip the plain docker build + push side")
    parser.add_argument("--docker-pull", action="store_true", help="also time docker pull into an empty data root")
    parser.add_argument("--drop-caches", action="store_true", help="empty the page cache before each pull (root)")
    parser.add_argument("--compression", type=parse_compression, default=None, metavar="zstd[:LEVEL]|estargz",
                        help="also pull each image pushed again with this layer compression (zstd: in full; "
                             "estargz: lazily, through the stargz snapshotter)")
    parser.add_argument("--workload", default=WORKLOAD,
                        help=f"Python code the first workload runs with {PYTHON} -c ('' for none)")
    parser.add_argument("--background-fetch", choices=("on", "off", "both"), default="on",
                        help="the stargz snapshotter's background fetch of each whole layer (its default: on); "
                             "off: only what is read (side estargz-ondemand); both: the two sides")
    parser.add_argument("--scratch", type=Path, default=Path("/var/tmp"),
                        help="where the nodes, the throw-away registries and the publish's spool go (the GPU "
                             "image's full pull needs about 10 GB)")
    parser.add_argument("--split", action="append", default=[], metavar="CHANNEL=REF",
                        help="also pull REF as the channel's 'split' side (e.g. the image with its pip layers split)")
    parser.add_argument("--containerd2", type=int, default=0, metavar="UNPACKS",
                        help="also pull the imagebuild and split sides with containerd 2.x, UNPACKS layers at once")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()

    for tool in (CONTAINERD, CTR):
        if not Path(tool).is_file():
            sys.exit(f"{tool} is missing (Debian's containerd package; scripts/bootstrap.sh installs docker.io)")
    lazy = args.compression is not None and args.compression.is_estargz
    for tool in (STARGZ_GRPC, STARGZ_RPULL) if lazy else ():
        if not tool.is_file():
            sys.exit(f"{tool} is missing (scripts/build-test-tools.sh builds it)")
    workload = [PYTHON, "-c", args.workload] if args.workload else None
    channels = [c for c in args.channels.split(",") if c]
    docker_cli()  # fails clearly when the engine's client is missing
    refs = {c: {"imagebuild": f"{args.region_registry}/{args.repository}:{c}"} for c in channels}
    for given in args.split:
        channel, _, ref = given.partition("=")
        if channel not in refs or not ref:
            sys.exit(f"--split {given}: give CHANNEL=REF for one of the channels ({', '.join(channels)})")
        refs[channel]["split"] = ref
    pulls: list[Pull] = []
    with tempfile.TemporaryDirectory(prefix="bench-ttr-", dir=args.scratch) as tmp:
        scratch = Path(tmp)
        registry = republished = None
        try:
            if args.compression is not None and not args.compression.is_gzip:
                republished, again = republished_images(args.region_registry, args.repository, channels,
                                                        args.compression, scratch)
                for channel, ref in again.items():
                    refs[channel][args.compression.algorithm] = ref
            if not args.no_peer:
                registry, peer = peer_images(args.matrix, args.base, channel_variants(args.report, channels), scratch)
                for channel, ref in peer.items():
                    refs[channel]["peer"] = ref
            def measure(channel: str, side: str, ref: str) -> None:
                for run in range(args.runs):
                    if side.startswith("estargz"):
                        assert republished is not None
                        pull = pull_lazily(scratch, channel, side, ref, republished, args.drop_caches, workload,
                                           side == "estargz")
                    else:
                        pull = pull_into_containerd(scratch, channel, side, ref, args.drop_caches, workload)
                    print(f"[{channel} {side} {run + 1}/{args.runs}] ready in {pull.ready_s} s "
                          f"({pull.fetched_bytes / 1e9:.3f} GB fetched), workload done at {pull.done_s} s "
                          f"({(pull.fetched_by_workload_bytes or 0) / 1e9:.3f} GB)", file=sys.stderr, flush=True)
                    pulls.append(pull)

            # The republished sides first; then their registry's storage goes, before the full pulls.
            lazy_sides = {"on": ["estargz"], "off": ["estargz-ondemand"], "both": ["estargz", "estargz-ondemand"]}
            for channel in channels:
                ref = refs[channel].pop("estargz", None)
                for side in lazy_sides[args.background_fetch] if ref else ():
                    measure(channel, side, ref)
                if "zstd" in refs[channel]:
                    measure(channel, "zstd", refs[channel].pop("zstd"))
            if republished is not None:
                republished.stop()
                shutil.rmtree(republished.dir, ignore_errors=True)
                republished = None
            for channel in channels:
                # Run by run, every side once: on a shared machine the load moves, and each side gets its share.
                for run in range(args.runs):
                    for side, ref in refs[channel].items():
                        again = args.containerd2 and side in ("imagebuild", "split")
                        for unpacks in (0, args.containerd2) if again else (0,):
                            named = f"c2-{side}" if unpacks else side
                            pull = pull_into_containerd(scratch, channel, named, ref, args.drop_caches, workload,
                                                        unpacks)
                            print(f"[{channel} {named} {run + 1}/{args.runs}] ready in {pull.ready_s} s "
                                  f"({pull.fetched_bytes / 1e9:.3f} GB fetched), workload done at {pull.done_s} s",
                                  file=sys.stderr, flush=True)
                            pulls.append(pull)
                    if args.docker_pull:
                        pulls.append(pull_into_docker(scratch, channel, refs[channel]["imagebuild"], args.drop_caches))
                        if "split" in refs[channel]:
                            pulls.append(pull_into_docker(scratch, channel, refs[channel]["split"], args.drop_caches,
                                                          side="docker-split"))
        finally:
            if republished is not None:
                republished.stop()
            if registry is not None:
                registry.stop()
                make_cold(docker.from_env(timeout=600), [registry.host], prune=False)  # the peer's tags

    def median(image: str, side: str) -> Pull | None:
        mine = sorted((p for p in pulls if p.image == image and p.side == side), key=lambda p: p.ready_s)
        return mine[len(mine) // 2] if mine else None

    result: dict = {"cores": os.cpu_count(), "runs": args.runs, "workload": args.workload,
                    "pulls": [asdict(p) | {"ready_s": p.ready_s, "done_s": p.done_s} for p in pulls], "ratios": {}}
    print(f"\n{'image':10} {'side':11} {'ready s':>8} {'pull s':>7} {'rootfs s':>8} {'fetched GB':>10} "
          f"{'workload s':>10} {'done s':>7} {'by then GB':>10} {'unpacked GB':>11} {'layers':>6} {'load':>5}")
    for channel in channels:
        for side in ("imagebuild", "split", "c2-imagebuild", "c2-split", "zstd", "estargz", "estargz-ondemand", "peer",
                     "docker", "docker-split"):
            pull = median(channel, side)
            if pull is None:
                continue
            fetched = f"{pull.fetched_bytes / 1e9:.3f}" if pull.fetched_bytes else "-"
            by_then = f"{pull.fetched_by_workload_bytes / 1e9:.3f}" if pull.fetched_by_workload_bytes else "-"
            unpacked = "lazy" if pull.lazy else f"{pull.unpacked_bytes / 1e9:.3f}"
            print(f"{channel:10} {side:11} {pull.ready_s:8.1f} {pull.pull_s:7.1f} {pull.rootfs_s:8.2f} {fetched:>10} "
                  f"{pull.workload_s if pull.workload_s is not None else '-':>10} "
                  f"{pull.done_s if pull.done_s is not None else '-':>7} {by_then:>10} "
                  f"{unpacked:>11} {pull.layers:6} {pull.load_before:5.1f}")
        ours, theirs = median(channel, "imagebuild"), median(channel, "peer")
        if ours and theirs:
            ratio = {"ready": round(theirs.ready_s / ours.ready_s, 2),
                     "fetched": round(ours.fetched_bytes / theirs.fetched_bytes, 3)}
            result["ratios"][channel] = ratio
            print(f"{channel:10} peer/imagebuild ready {ratio['ready']}x; imagebuild fetches "
                  f"{ratio['fetched'] * 100:.1f}% of the peer's bytes")
        for whole, split in [(median(channel, one), median(channel, other)) for one, other in (
                ("imagebuild", "split"), ("c2-imagebuild", "c2-split"), ("docker", "docker-split"))]:
            if whole and split:  # the same files in other layers: the time is the one figure that moves
                result["ratios"][f"{channel}-{split.side}"] = {"ready": round(whole.ready_s / split.ready_s, 2)}
                print(f"{channel:10} {split.side} is ready {whole.ready_s / split.ready_s:.2f}x as fast as {whole.side}")
        for side in ("imagebuild", "split"):
            pull = median(channel, side)
            if pull is not None and pull.layer_blobs:
                print(f"{channel:10} {side:11} layers, MB compressed / unpacked: " + "  ".join(
                    f"{b / 1e6:.1f}/{u / 1e6:.1f}" for b, u in zip(pull.layer_blobs, pull.layer_bytes)))
        for lazy_side in ("estargz", "estargz-ondemand"):
            lazy = median(channel, lazy_side)
            for name, full in (("imagebuild", ours), ("peer", theirs)):
                if lazy and full:
                    ratio = {"ready": round(full.ready_s / lazy.ready_s, 2)}
                    if full.done_s and lazy.done_s:
                        ratio["done"] = round(full.done_s / lazy.done_s, 2)
                    result["ratios"][f"{channel}-{lazy_side}-vs-{name}"] = ratio
                    print(f"{channel:10} {name}/{lazy_side} ready {ratio['ready']}x"
                          + (f", workload done {ratio['done']}x" if "done" in ratio else ""))
        zstd = median(channel, "zstd")
        if ours and zstd:
            ratio = {"ready": round(ours.ready_s / zstd.ready_s, 2),
                     "fetched": round(zstd.fetched_bytes / ours.fetched_bytes, 3)}
            result["ratios"][f"{channel}-zstd"] = ratio
            print(f"{channel:10} gzip/zstd ready {ratio['ready']}x; zstd fetches {ratio['fetched'] * 100:.1f}% "
                  "of gzip's bytes")
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
