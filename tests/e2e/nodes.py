"""Containerd "nodes" for the tests and benchmarks: a real containerd each (Debian's 1.6, what a kubelet's node
runs), with its own root, state and socket, nothing cached and nothing shared with the engine's containerd.

The CRI plugin is off (there is no kubelet here) and so are the snapshotters a node would not use;
images are pulled and checked through `ctr`, containerd's own client. `stop()` unmounts whatever a
prepared container left mounted and removes the node's directory.

A lazy node (`lazy=True`) also runs the stargz snapshotter (our build of its daemon,
scripts/build-test-tools.sh) with a root of its own, named in containerd's config as the proxy
snapshotter plugin `stargz`. `rpull` pulls through it (stargz-rpull: containerd 1.6's `ctr pull`
passes no remote-snapshot labels, so it would unpack every layer itself); the snapshotter then
mounts each eStargz layer over FUSE from the registry, and `ctr --snapshotter stargz` runs on it.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

CONTAINERD = "/usr/bin/containerd"
CTR = "/usr/bin/ctr"
NAMESPACE = "k8s.io"  # the kubelet's: what the node's pods would find
TOOLS = Path("/opt/imagebuild-tools/bin")
STARGZ_GRPC = TOOLS / "containerd-stargz-grpc"
STARGZ_RPULL = TOOLS / "stargz-rpull"
STARGZ = "stargz"  # the proxy snapshotter's name in the node's containerd config


class NodeError(RuntimeError):
    """A node could not be started; the message says what to install or look at."""


def unmount_below(directory: Path) -> None:
    """Lazily unmount whatever is mounted under directory (a prepared container's overlay)."""
    subprocess.run(["sh", "-c", f"grep -o ' {directory}[^ ]*' /proc/mounts | xargs -r -n1 umount -l"],
                   capture_output=True, check=False)


class ContainerdNode:
    """One node: a containerd of its own, started at once, stopped by `stop()` (or `with`)."""

    def __init__(self, scratch: Path, name: str = "node", binary: str = CONTAINERD, client: str = CTR,
                 settings: tuple[str, ...] = (), lazy: bool = False, background_fetch: bool = True):
        """`binary` and `client`: another containerd and its ctr (a 2.x build); `settings`: lines added to its
        config.toml (plugin settings such as the transfer service's max_concurrent_unpacks); `lazy`: the stargz
        snapshotter beside it as a proxy plugin, for eStargz images pulled with `rpull`."""
        for tool in (binary, client, *((STARGZ_GRPC, STARGZ_RPULL) if lazy else ())):
            if not Path(tool).is_file():
                raise NodeError(f"{tool} is missing: " + (
                    "scripts/build-test-tools.sh builds it" if str(tool).startswith(str(TOOLS)) else
                    "Debian's containerd package (scripts/bootstrap.sh installs docker.io, which brings it)"))
        self.client = client
        self.name = name
        self.dir = Path(tempfile.mkdtemp(prefix=f"containerd-{name}-", dir=scratch))
        self.root = self.dir / "root"
        # Sockets under a short path: a unix socket's path must stay under 104 bytes, and test folders do not.
        self.state = Path(tempfile.mkdtemp(prefix="ibn-", dir="/tmp"))
        self.socket = self.state / "containerd.sock"
        self.stargz: subprocess.Popen | None = None
        self.stargz_root = self.dir / "stargz"
        self.stargz_log = self.dir / "stargz.log"
        self.process: subprocess.Popen | None = None
        lines = [
            "version = 2", f'root = "{self.root}"', f'state = "{self.state}"',
            'disabled_plugins = ["io.containerd.grpc.v1.cri", "io.containerd.snapshotter.v1.btrfs",'
            ' "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.aufs",'
            ' "io.containerd.snapshotter.v1.devmapper"]',
            "[grpc]", f'  address = "{self.socket}"', "[ttrpc]", f'  address = "{self.socket}.ttrpc"',
            '[plugins."io.containerd.internal.v1.opt"]', f'  path = "{self.dir / "opt"}"', *settings]
        if lazy:
            stargz_socket = self.state / "stargz.sock"
            stargz_config = self.dir / "stargz.toml"
            # Background fetch (the default) fetches each whole layer after mounting it, behind the reads.
            stargz_config.write_text(f"no_background_fetch = {'false' if background_fetch else 'true'}\n")
            with self.stargz_log.open("w") as out:
                self.stargz = subprocess.Popen([str(STARGZ_GRPC), "--address", str(stargz_socket), "--root",
                                                str(self.stargz_root), "--config", str(stargz_config)],
                                               stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            self._wait_for(stargz_socket, self.stargz, self.stargz_log, "the stargz snapshotter")
            lines += ["[proxy_plugins]", f"  [proxy_plugins.{STARGZ}]", '    type = "snapshot"',
                      f'    address = "{stargz_socket}"']
        config = self.dir / "config.toml"
        config.write_text("\n".join([*lines, ""]))
        self.log = self.dir / "containerd.log"
        with self.log.open("w") as out:
            self.process = subprocess.Popen([binary, "--config", str(config)], stdout=out,
                                            stderr=subprocess.STDOUT, start_new_session=True)
        self._wait_for(self.socket, self.process, self.log, "containerd")

    def _wait_for(self, socket: Path, process: subprocess.Popen, log: Path, what: str) -> None:
        deadline = time.monotonic() + 30
        while not socket.exists():
            if process.poll() is not None or time.monotonic() > deadline:
                text = log.read_text()[-2000:]
                self.stop()
                raise NodeError(f"{what} for {self.name} did not start:\n{text}")
            time.sleep(0.05)

    def ctr(self, *args: str, namespace: str = NAMESPACE, timeout: float = 3600) -> subprocess.CompletedProcess:
        return subprocess.run([self.client, "--address", str(self.socket), "--namespace", namespace, *args],
                              capture_output=True, text=True, timeout=timeout, check=False)

    def rpull(self, ref: str, namespace: str = NAMESPACE, timeout: float = 3600) -> subprocess.CompletedProcess:
        """Pull `ref` lazily through the stargz snapshotter (a lazy node's); prints the manifest digest."""
        return subprocess.run([str(STARGZ_RPULL), "--address", str(self.socket), "--namespace", namespace,
                               "--snapshotter", STARGZ, "--plain-http", ref],
                              capture_output=True, text=True, timeout=timeout, check=False)

    def fuse_mounts(self) -> list[str]:
        """The mount points the stargz snapshotter serves over FUSE (one per lazily mounted layer)."""
        mounts = []
        for line in Path("/proc/mounts").read_text().splitlines():
            fields = line.split()
            if len(fields) >= 3 and fields[1].startswith(str(self.stargz_root)) and fields[2].startswith("fuse"):
                mounts.append(fields[1])
        return mounts

    def images(self, namespace: str = NAMESPACE) -> dict[str, str]:
        """Image name -> the digest it names, as the node lists them."""
        listed = self.ctr("images", "ls", namespace=namespace)
        assert listed.returncode == 0, listed.stderr
        rows = [line.split() for line in listed.stdout.splitlines()[1:] if line.strip()]
        return {row[0]: row[2] for row in rows}

    def stop(self) -> None:
        # containerd first (it holds the snapshotter's mounts in use), then the snapshotter, whose SIGTERM
        # unmounts its FUSE layers.
        for process in (self.process, self.stargz):
            if process is None or process.poll() is not None:
                continue
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        for directory in (self.dir, self.state):
            unmount_below(directory)
            shutil.rmtree(directory, ignore_errors=True)

    def __enter__(self) -> ContainerdNode:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
