"""Calls one of Paddle's library loaders in a process of its own: `python dynload_probe.py LIB SYMBOL`.

smoke_lib.probe_loader runs it with LD_DEBUG=files, so glibc logs every name the loader hands to
dlopen(). Prints one JSON line, {"opened": the path it loaded, or null}. A loader that fails
either returns null (and logs why) or throws a C++ exception that nothing here can catch: the
process aborts with Paddle's message on stderr, which the caller reads.

Runs with the image's Python (3.8 or newer) and only the standard library.
"""
import ctypes
import json
import os
import sys

RTLD_DI_LINKMAP = 2


class LinkMap(ctypes.Structure):  # the head of glibc's struct link_map
    _fields_ = [("l_addr", ctypes.c_void_p), ("l_name", ctypes.c_char_p)]


def loaded_path(handle: int):
    """The file a dlopen() handle refers to (glibc's dlinfo; in libdl before glibc 2.34)."""
    for libdl in (None, "libdl.so.2"):
        try:
            dlinfo = ctypes.CDLL(libdl).dlinfo
        except (OSError, AttributeError):
            continue
        link_map = ctypes.POINTER(LinkMap)()
        if dlinfo(ctypes.c_void_p(handle), RTLD_DI_LINKMAP, ctypes.byref(link_map)) == 0:
            return link_map.contents.l_name.decode(errors="replace")
    return "(loaded; path unknown)"


def main(library: str, symbol: str) -> None:
    loader = getattr(ctypes.CDLL(library), symbol)
    loader.restype = ctypes.c_void_p
    handle = loader()
    sys.stdout.write(json.dumps({"opened": loaded_path(handle) if handle else None}) + "\n")
    sys.stdout.flush()
    os._exit(0)  # skip Paddle's static destructors: they have nothing to say here


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
