"""Helpers shared by the smoke tests (and open to a matrix's extra tests): `from smoke_lib import train`.

Lives beside run.py, which puts this folder on sys.path; test modules themselves are
imported with --import-mode=importlib and cannot import each other.
"""
from __future__ import annotations

import math
import os
import stat
from typing import Dict, List, Tuple


def major_minor(version: str) -> Tuple[int, ...]:
    """'8.6.0' -> (8, 6); '11.8' -> (11, 8)."""
    return tuple(int(part) for part in version.split(".")[:2])


def parse_ldconfig(text: str) -> Dict[str, List[str]]:
    """`ldconfig -p` output -> soname -> paths (what dlopen() finds through the loader cache)."""
    cache: Dict[str, List[str]] = {}
    for line in text.splitlines():
        name, sep, path = line.strip().partition(" => ")
        if sep:
            cache.setdefault(name.split(" (", 1)[0], []).append(path)
    return cache


def cudnn_version_string(value: int) -> str:
    """cudnnGetVersion(): 8600 -> '8.6.0' (cuDNN 7 and 8: M*1000+m*100+p), 90100 -> '9.1.0' (9+)."""
    if value >= 10000:
        return f"{value // 10000}.{value % 10000 // 100}.{value % 100}"
    return f"{value // 1000}.{value % 1000 // 100}.{value % 100}"


def setuid_files(root: str = "/") -> Tuple[List[str], List[str]]:
    """Regular files with a setuid or setgid bit, like `find / -xdev -perm /6000 -type f`.

    Returns (files, folders this user could not read). Directories on another device (proc,
    sys, dev, the suite's own mounts) are not entered, as with -xdev.
    """
    device = os.lstat(root).st_dev
    found: List[str] = []
    unreadable: List[str] = []
    pending = [root]
    while pending:
        folder = pending.pop()
        try:
            entries = list(os.scandir(folder))
        except OSError:
            unreadable.append(folder)
            continue
        for entry in entries:
            try:
                info = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISDIR(info.st_mode):
                if info.st_dev == device:
                    pending.append(entry.path)
            elif stat.S_ISREG(info.st_mode) and info.st_mode & (stat.S_ISUID | stat.S_ISGID):
                found.append(entry.path)
    return sorted(found), sorted(unreadable)


def train(paddle, device: str, steps: int, conv: bool = False) -> List[float]:
    """A few SGD steps of a small model on a fixed regression task; the losses, one per step."""
    paddle.set_device(device)
    paddle.seed(20240611)
    nn = paddle.nn
    x = paddle.randn([64, 1, 8, 8] if conv else [64, 16], dtype="float32")
    if conv:
        model = nn.Sequential(nn.Conv2D(1, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(256, 1))
    else:
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    y = (x.reshape([64, -1]).sum(axis=1, keepdim=True) * 0.1).detach()
    opt = paddle.optimizer.SGD(learning_rate=0.05, parameters=model.parameters())
    losses = []
    for _ in range(steps):
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
    return losses


def assert_learns(losses: List[float]) -> None:
    assert all(math.isfinite(v) for v in losses), f"non-finite loss: {losses}"
    assert losses[-1] < losses[0] * 0.9, f"the loss did not decrease: {losses}"
