"""A Secret volume as the kubelet writes one, for tests of the webhook's certificate reload.

The kubelet's atomic writer keeps each version of a Secret in a folder of its own (`..<version>`),
points the link `..data` at the current one, and makes each key a link through it (`tls.crt ->
..data/tls.crt`). An update writes a new folder, then renames a new `..data` link over the old one:
a reader sees the old pair or the new one, never half of each. `rewrite` is the other way a pair
changes, one file after the other, as a hand-rolled copy does.
"""
from __future__ import annotations

import os
import uuid
from pathlib import Path

KEYS = ("tls.crt", "tls.key")


class MountedSecret:
    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.cert, self.key = (root / name for name in KEYS)

    def publish(self, cert_pem: bytes, key_pem: bytes) -> None:
        """The kubelet's update: a new version folder, then one rename of the ..data link."""
        version = self.root / f"..{uuid.uuid4().hex[:12]}"
        version.mkdir()
        (version / "tls.crt").write_bytes(cert_pem)
        (version / "tls.key").write_bytes(key_pem)
        (version / "tls.key").chmod(0o600)
        staged = self.root / "..data_tmp"
        staged.symlink_to(version.name)
        os.replace(staged, self.root / "..data")
        for name in KEYS:
            if not (self.root / name).is_symlink():
                (self.root / name).symlink_to(f"..data/{name}")

    def publish_files(self, cert: Path, key: Path) -> None:
        self.publish(cert.read_bytes(), key.read_bytes())

    def rewrite(self, name: str, content: bytes) -> None:
        """One file of the current version replaced (written beside it, renamed over it), the other left as it is."""
        target = (self.root / name).resolve()
        staged = target.with_name(f".{name}.tmp")
        staged.write_bytes(content)
        os.replace(staged, target)
