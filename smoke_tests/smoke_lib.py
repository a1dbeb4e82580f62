"""Helpers shared by the smoke tests (and open to a matrix's extra tests): `from smoke_lib import train`.

Lives beside run.py, which puts this folder on sys.path; test modules themselves are
imported with --import-mode=importlib and cannot import each other.
"""
from __future__ import annotations

import json
import math
import os
import re
import stat
import struct
import subprocess
import sys
from typing import BinaryIO, Dict, List, NamedTuple, Optional, Tuple


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



def all_reduce_rank_plus_one() -> Tuple[int, int, float]:
    """One process of paddle.distributed.spawn: all-reduce (sum) of rank + 1 over NCCL.

    Lives here, not in a test module, because spawn pickles it by module name.
    Returns (rank, world size, the sum): with two processes, 1 + 2 = 3 in both.
    """
    import paddle
    import paddle.distributed as dist

    dist.init_parallel_env()  # NCCL, one GPU per process
    value = paddle.to_tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(value)
    return dist.get_rank(), dist.get_world_size(), float(value.numpy()[0])

# --- the libraries Paddle opens at run time (phi::dynload) -----------------------------------
#
# Paddle's GPU build links none of its CUDA libraries: libphi.so has one exported loader per
# library, phi::dynload::Get<Name>DsoHandle(), that dlopen()s it by name on first use. The loaders
# come from the symbol table; the names they open are learned by calling each one (see
# dynload_probe.py), because short names are built in code, not stored as strings.

# Loaders whose library an image need not carry, and why. Any other loader (a new Paddle's
# included) opens a required library.
NOT_REQUIRED = {
    "CUDA": "the driver's libcuda: the host's NVIDIA container toolkit mounts it at run time",
    "TensorRt": "TensorRT: only Paddle Inference's TensorRT engine opens it, never training",
    "CusparseLt": "cuSPARSELt: 2:4 structured-sparsity kernels only; NVIDIA ships no CUDA 11 wheel",
    "Nvjpeg": "nvJPEG: only GPU JPEG decoding (paddle.vision.ops.decode_jpeg) opens it",
    "CUPTI": "CUPTI: only the GPU profiler (paddle.profiler) opens it; Paddle carries on without it",
    "Nvtx": "NVTX: only profiler range markers open it",
    "MKLRT": "oneMKL's runtime: only the oneMKL FFT backend opens it, which PyPI builds leave out",
    "XPTI": "Kunlun XPU's profiler: not part of a CUDA build",
}

_ELF_HEADER = struct.Struct("<16sHHIQQQIHHHHHH")
_SECTION = struct.Struct("<IIQQQQIIQQ")
_SYMBOL = struct.Struct("<IBBHQQ")
_SHT_DYNSYM = 11
_LOADER = re.compile(r"_ZN3phi7dynload(\d+)(Get(\w+)DsoHandle)Ev")


class Section(NamedTuple):
    name: str
    type: int
    offset: int
    size: int
    link: int  # for a symbol table: the index of its string table


def _read_at(f: BinaryIO, offset: int, size: int) -> bytes:
    f.seek(offset)
    data = f.read(size)
    if len(data) != size:
        raise ValueError("truncated ELF file")
    return data


def elf_sections(f: BinaryIO) -> List[Section]:
    """The section headers of a little-endian ELF64 file (x86-64 and aarch64 Linux), in order."""
    header = _ELF_HEADER.unpack(_read_at(f, 0, _ELF_HEADER.size))
    ident, shoff, shentsize, shnum, shstrndx = header[0], header[6], header[11], header[12], header[13]
    if ident[:4] != b"\x7fELF" or ident[4] != 2 or ident[5] != 1:
        raise ValueError("not a little-endian ELF64 file")
    raw = [_SECTION.unpack(_read_at(f, shoff + i * shentsize, _SECTION.size)) for i in range(shnum)]
    names = _read_at(f, raw[shstrndx][4], raw[shstrndx][5])
    return [Section(_c_string(names, s[0]), s[1], s[4], s[5], s[6]) for s in raw]


def elf_machine(path: str) -> Optional[int]:
    """An ELF file's e_machine (62: x86-64, 183: aarch64); None for a file that is not little-endian ELF64."""
    try:
        with open(path, "rb") as f:
            header = _ELF_HEADER.unpack(_read_at(f, 0, _ELF_HEADER.size))
    except (OSError, ValueError, struct.error):
        return None
    ident = header[0]
    if ident[:4] != b"\x7fELF" or ident[4] != 2 or ident[5] != 1:
        return None
    return int(header[2])


def _c_string(table: bytes, offset: int) -> str:
    return table[offset:table.index(b"\0", offset)].decode("ascii", "replace")


def dynamic_symbols(path: str) -> List[str]:
    """The symbols a shared library defines in its dynamic symbol table (what dlsym() finds)."""
    with open(path, "rb") as f:
        sections = elf_sections(f)
        dynsym = next((s for s in sections if s.type == _SHT_DYNSYM), None)
        if dynsym is None:
            return []
        strtab = sections[dynsym.link]
        names = _read_at(f, strtab.offset, strtab.size)
        table = _read_at(f, dynsym.offset, dynsym.size)
    found = []
    for i in range(0, len(table) - _SYMBOL.size + 1, _SYMBOL.size):
        name, _info, _other, shndx, _value, _size = _SYMBOL.unpack_from(table, i)
        if shndx != 0 and name:  # 0: undefined here, imported from elsewhere
            found.append(_c_string(names, name))
    return found


def section_bytes(path: str, name: str) -> bytes:
    with open(path, "rb") as f:
        section = next((s for s in elf_sections(f) if s.name == name), None)
        return _read_at(f, section.offset, section.size) if section else b""


class Loader(NamedTuple):
    name: str  # Curand, from phi::dynload::GetCurandDsoHandle
    symbol: str  # the mangled name ctypes calls

    @property
    def required(self) -> bool:
        return self.name not in NOT_REQUIRED


def dynload_loaders(symbols: List[str]) -> List[Loader]:
    """phi::dynload::Get<Name>DsoHandle() loaders (no arguments) among mangled symbol names."""
    found = {}
    for symbol in symbols:
        m = _LOADER.fullmatch(symbol)
        if m and int(m.group(1)) == len(m.group(2)):
            found[m.group(3)] = Loader(m.group(3), symbol)
    return [found[name] for name in sorted(found, key=str.lower)]


def paddle_dynload_libraries(paddle_dir: str) -> Tuple[Optional[str], List[Loader]]:
    """The shared library in an installed Paddle that holds its loaders, and the loaders.

    Paddle 2.x and 3.x keep them in paddle/libs/libphi*.so; other libraries there are looked
    at too, so a Paddle that moves them is still read.
    """
    folder = os.path.join(paddle_dir, "libs")
    try:
        names = sorted(os.listdir(folder), key=lambda n: (not n.startswith("libphi"), n))
    except OSError:
        return None, []
    for name in names:
        path = os.path.join(folder, name)
        if ".so" not in name or not os.path.isfile(path):
            continue
        try:
            loaders = dynload_loaders(dynamic_symbols(path))
        except (OSError, ValueError):
            continue
        if loaders:
            return path, loaders
    return None, []


_DLOPEN = re.compile(r"file=(\S+) \[\d+\];\s+dynamically loaded by (\S+) \[\d+\]")


def sonames_in(data: bytes, prefix: str) -> List[str]:
    """NUL-terminated strings like '<prefix>....so.<n>' in a section: names a library dlopen()s."""
    pattern = re.compile(re.escape(prefix.encode()) + rb"[A-Za-z0-9_]*\.so(?:\.[0-9]+)*(?=\0)")
    return sorted({m.group().decode() for m in pattern.finditer(data)})


PROBE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dynload_probe.py")


class Probe(NamedTuple):
    """What one of Paddle's loaders did when called in a process of its own."""

    tried: List[str]  # what it handed to dlopen(), in order: names, and paths where it has them
    opened: Optional[str]  # the file it loaded; None when it failed
    error: Optional[str]  # why it failed, in Paddle's or the dynamic loader's words
    timed_out: bool = False

    @property
    def names(self) -> List[str]:
        """What it looked up by name: through the loader cache, LD_LIBRARY_PATH and RUNPATH."""
        return [entry for entry in self.tried if "/" not in entry]


_ERROR_CODE = re.compile(r"\(error code is (.+?)\)")
_LD_DEBUG_LINE = re.compile(r"^\s*\d+:")


def probe_loader(library: str, symbol: str, timeout_s: float, python: str = sys.executable) -> Probe:
    """Call `symbol` (a phi::dynload loader) of `library` in a child, watching its dlopen() calls."""
    env = dict(os.environ, LD_DEBUG="files")
    try:
        proc = subprocess.run([python, "-I", PROBE, library, symbol], capture_output=True, env=env,
                              timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as exc:
        err = (exc.stderr or b"").decode(errors="replace")
        return Probe(dlopened(err, library), None, f"did not return within {timeout_s:g} s", True)
    err = proc.stderr.decode(errors="replace")
    tried = dlopened(err, library)
    if proc.returncode == 0:
        try:
            opened = json.loads(proc.stdout.decode().strip().splitlines()[-1])["opened"]
        except (ValueError, IndexError, KeyError, TypeError):
            opened = None
        if opened:
            return Probe(tried, opened, None)
    return Probe(tried, None, loader_error(err, proc.returncode))


def dlopened(ld_debug: str, library: str) -> List[str]:
    """What `library` handed to dlopen(), from glibc's LD_DEBUG=files lines, in order, once each."""
    tried: List[str] = []
    for name, by in _DLOPEN.findall(ld_debug):
        if os.path.basename(by) == os.path.basename(library) and name not in tried:
            tried.append(name)
    return tried


def loader_error(stderr: str, returncode: int) -> str:
    """The reason in Paddle's message ("error code is ..."), else its last line of its own."""
    found = _ERROR_CODE.findall(stderr)
    if found:
        return found[-1]
    lines = [line.strip() for line in stderr.splitlines() if line.strip() and not _LD_DEBUG_LINE.match(line)]
    why = lines[-1] if lines else "no message"
    return f"{why} (exit status {returncode})"


# --- what Paddle says about itself ---------------------------------------------------------

_FACTS_SCRIPT = """
import json, paddle
cuda = paddle.is_compiled_with_cuda()
print(json.dumps({"version": paddle.__version__, "compiled_with_cuda": cuda, "cuda": paddle.version.cuda(),
                  "cudnn": paddle.version.cudnn(), "gpus": paddle.device.cuda.device_count() if cuda else 0}))
"""


class PaddleFacts(NamedTuple):
    version: Optional[str] = None
    compiled_with_cuda: bool = False
    cuda: Optional[str] = None  # as Paddle reports them: '11.8', or 'False' in a CPU build
    cudnn: Optional[str] = None
    gpus: int = 0
    error: Optional[str] = None  # why `import paddle` failed, or that it hung


def paddle_facts(timeout_s: float, python: str = sys.executable) -> PaddleFacts:
    """Import Paddle in a child process and ask it its version, build and GPU count.

    One import answers every test that only needs these; a hang costs `timeout_s` once.
    """
    try:
        proc = subprocess.run([python, "-c", _FACTS_SCRIPT], capture_output=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return PaddleFacts(error=f"it did not finish within {timeout_s:g} s")
    if proc.returncode != 0:
        lines = [line for line in proc.stderr.decode(errors="replace").splitlines() if line.strip()]
        return PaddleFacts(error=f"{lines[-1] if lines else 'no message'} (exit status {proc.returncode})")
    data = json.loads(proc.stdout.decode().strip().splitlines()[-1])
    return PaddleFacts(version=data["version"], compiled_with_cuda=bool(data["compiled_with_cuda"]),
                       cuda=str(data["cuda"]), cudnn=str(data["cudnn"]), gpus=int(data["gpus"]))
