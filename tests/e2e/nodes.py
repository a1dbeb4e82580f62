"""Containerd "nodes" for the tests and benchmarks: a real containerd each (Debian's 1.6, what a kubelet's node
runs), with its own root, state and socket, nothing cached and nothing shared with the engine's containerd.

The CRI plugin is off (there is no kubelet here) and so are the snapshotters a node would not use;
images are pulled and checked through `ctr`, containerd's own client. `stop()` unmounts whatever a
prepared container left mounted and removes the node's directory.
"""
from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from pathlib import Path

CONTAINERD = "/usr/bin/containerd"
CTR = "/usr/bin/ctr"
NAMESPACE = "k8s.io"  # the kubelet's: what the node's pods would find


class NodeError(RuntimeError):
    """A node could not be started; the message says what to install or look at."""


def unmount_below(directory: Path) -> None:
    """Lazily unmount whatever is mounted under directory (a prepared container's overlay)."""
    subprocess.run(["sh", "-c", f"grep -o ' {directory}[^ ]*' /proc/mounts | xargs -r -n1 umount -l"],
                   capture_output=True, check=False)


class ContainerdNode:
    """One node: a containerd of its own, started at once, stopped by `stop()` (or `with`)."""

    def __init__(self, scratch: Path, name: str = "node", binary: str = CONTAINERD, client: str = CTR,
                 settings: tuple[str, ...] = ()):
        """`binary` and `client`: another containerd and its ctr (a 2.x build); `settings`: lines added to its
        config.toml (plugin settings such as the transfer service's max_concurrent_unpacks)."""
        for tool in (binary, client):
            if not Path(tool).is_file():
                raise NodeError(f"{tool} is missing: Debian's containerd package (scripts/bootstrap.sh installs "
                                f"docker.io, which brings it), or for a 2.x build scripts/build-test-tools.sh")
        self.client = client
        self.name = name
        self.dir = Path(tempfile.mkdtemp(prefix=f"containerd-{name}-", dir=scratch))
        self.root = self.dir / "root"
        # Sockets under a short path: a unix socket's path must stay under 104 bytes, and test folders do not.
        self.state = Path(tempfile.mkdtemp(prefix="ibn-", dir="/tmp"))
        self.socket = self.state / "containerd.sock"
        config = self.dir / "config.toml"
        config.write_text("\n".join([
            "version = 2", f'root = "{self.root}"', f'state = "{self.state}"',
            'disabled_plugins = ["io.containerd.grpc.v1.cri", "io.containerd.snapshotter.v1.btrfs",'
            ' "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.aufs",'
            ' "io.containerd.snapshotter.v1.devmapper"]',
            "[grpc]", f'  address = "{self.socket}"', "[ttrpc]", f'  address = "{self.socket}.ttrpc"',
            '[plugins."io.containerd.internal.v1.opt"]', f'  path = "{self.dir / "opt"}"', *settings, ""]))
        self.log = self.dir / "containerd.log"
        with self.log.open("w") as out:
            self.process = subprocess.Popen([binary, "--config", str(config)], stdout=out,
                                            stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 30
        while not self.socket.exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                text = self.log.read_text()[-2000:]
                self.stop()
                raise NodeError(f"containerd for {name} did not start:\n{text}")
            time.sleep(0.05)

    def ctr(self, *args: str, namespace: str = NAMESPACE, timeout: float = 3600) -> subprocess.CompletedProcess:
        return subprocess.run([self.client, "--address", str(self.socket), "--namespace", namespace, *args],
                              capture_output=True, text=True, timeout=timeout, check=False)

    def images(self, namespace: str = NAMESPACE) -> dict[str, str]:
        """Image name -> the digest it names, as the node lists them."""
        listed = self.ctr("images", "ls", namespace=namespace)
        assert listed.returncode == 0, listed.stderr
        rows = [line.split() for line in listed.stdout.splitlines()[1:] if line.strip()]
        return {row[0]: row[2] for row in rows}

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        for directory in (self.dir, self.state):
            unmount_below(directory)
            shutil.rmtree(directory, ignore_errors=True)

    def __enter__(self) -> ContainerdNode:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
