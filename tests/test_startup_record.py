"""What an image's start-up reads (imagebuild/build/startup.py), the pure parts: which health check is recorded,
the recorder's record read back as the untrusted output it is, and which files are prefetched. The recording
itself runs in a real image in tests/e2e/test_release.py."""
from __future__ import annotations

import json

import pytest

from imagebuild.build.startup import (
    MARK,
    MAX_PATHS,
    Recorded,
    StartupCommand,
    parse_recorded,
    split,
    startup_command,
)


def _config(test: object) -> dict:
    return {"Healthcheck": {"Test": test, "Interval": 60_000_000_000}}


def _line(files: object, mapped: object = None) -> str:
    return MARK + json.dumps({"files": files, "mapped": {} if mapped is None else mapped})


def test_the_release_layers_health_check_is_the_start_up_recorded():
    config = _config(["CMD", "/opt/venv/bin/python", "-c", "import paddle"])
    assert startup_command(config) == StartupCommand("/opt/venv/bin/python", "import paddle")


@pytest.mark.parametrize("test", [
    None, [], ["NONE"], ["CMD-SHELL", "python -c 'import paddle'"], ["CMD", "/bin/true"],
    ["CMD", "/usr/bin/curl", "-c", "x"], ["CMD", "python", "-c", "import paddle"],  # not a full path
    ["CMD", "/opt/venv/bin/python", "-m", "paddle"], ["CMD", "/opt/venv/bin/python", "-c", 5],
])
def test_any_other_health_check_gives_no_start_up(test):
    assert startup_command(_config(test)) is None
    assert startup_command({}) is None


def test_the_recorders_record_is_read_from_its_last_marked_line():
    output = (f"paddle says hello\n{_line(['/old'])}\nmore\n"
              + _line(["/usr/bin/python3", "/a", "/a"], {"/a": [1, 2]}))
    assert parse_recorded(output) == Recorded(["/usr/bin/python3", "/a"], {"/a": (1, 2)})


@pytest.mark.parametrize(("output", "problem"), [
    ("nothing", "printed no list"),
    (MARK + "[]", "not a list"),
    (_line({}), "not a list"),
    (_line(["relative/path"]), "not an absolute path"),
    (_line(["/a\x00b"]), "not an absolute path"),
    (_line([5]), "not an absolute path"),
    (_line(["/" + "a" * 5000]), "not an absolute path"),
    (_line(["/a"] * (MAX_PATHS + 1)), "at most"),
    (_line(["/a"], {"/a": [1]}), "not two whole numbers"),
    (_line(["/a"], {"/a": [1, -2]}), "not two whole numbers"),
    (_line(["/a"], {"/a": [True, 2]}), "not two whole numbers"),
    (_line(["/a"], {"a": [1, 2]}), "not an absolute path"),
])
def test_a_record_that_is_not_absolute_paths_and_chunk_counts_is_refused(output, problem):
    with pytest.raises(ValueError, match=problem):
        parse_recorded(output)


def test_a_large_library_touched_in_less_than_half_its_chunks_is_left_to_on_demand_reads():
    recorded = Recorded(["/usr/bin/python3.11", "/libphi.so", "/libpaddle.so", "/small.so", "/half.so", "/x.py"],
                        {"/usr/bin/python3.11": (2, 2), "/libphi.so": (41, 468), "/libpaddle.so": (41, 112),
                         "/small.so": (1, 4), "/half.so": (5, 10)})
    first, on_demand = split(recorded)
    assert first == ["/usr/bin/python3.11", "/small.so", "/half.so", "/x.py"]
    assert on_demand == {"/libphi.so": (41, 468), "/libpaddle.so": (41, 112)}
