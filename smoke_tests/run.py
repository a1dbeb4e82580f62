"""Entry point of the smoke suite inside an image: `python -B /smoke/suite/run.py [pytest args]`.

The images carry no pytest. `imagebuild test` mounts a read-only folder of pure-Python wheels
installed on the host with `pip install --target` (pinned, hash-checked), in two parts:

    /smoke/pytest/first   pytest, _pytest, pluggy, iniconfig: put in front of sys.path, so the
                          test runner is the pinned one even when the image has its own pytest
    /smoke/pytest/last    packaging, tomli, exceptiongroup: put at the end, so an image that has
                          its own copy (Paddle's dependencies may) keeps using that one

so the tests see the image's own libraries, exactly as its users do.
"""
import os
import sys

HARNESS = os.environ.get("IMAGEBUILD_SMOKE_HARNESS", "/smoke/pytest")
SUITE = os.path.dirname(os.path.abspath(__file__))

# Plugins the image happens to have installed (anyio, ...) would otherwise load themselves.
os.environ.setdefault("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
sys.path.insert(0, os.path.join(HARNESS, "first"))
sys.path.insert(1, SUITE)  # the imagebuild_smoke plugin
sys.path.append(os.path.join(HARNESS, "last"))

if __name__ == "__main__":  # not when multiprocessing's spawn re-imports this as __mp_main__
    import pytest  # (only importable once the paths above are set)

    sys.exit(pytest.main(["-c", os.path.join(SUITE, "pytest.ini"), *sys.argv[1:]]))
