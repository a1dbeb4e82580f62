"""What an image's start-up reads (imagebuild/build/startup.py), the pure parts: which health check is recorded,
and the recorder's list read back as the untrusted output it is. The recording itself runs in a real image in
tests/e2e/test_publish.py."""
from __future__ import annotations

import json

import pytest

from imagebuild.build.startup import MARK, MAX_PATHS, StartupCommand, parse_files, startup_command


def _config(test: object) -> dict:
    return {"Healthcheck": {"Test": test, "Interval": 60_000_000_000}}


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


def test_the_recorders_list_is_read_from_its_last_marked_line():
    output = f"paddle says hello\n{MARK}[\"/old\"]\nmore\n{MARK}" + json.dumps(["/usr/bin/python3", "/a", "/a"])
    assert parse_files(output) == ["/usr/bin/python3", "/a"]


@pytest.mark.parametrize(("output", "problem"), [
    ("nothing", "printed no list"),
    (MARK + "{}", "not a list"),
    (MARK + json.dumps(["relative/path"]), "not an absolute path"),
    (MARK + json.dumps(["/a\x00b"]), "not an absolute path"),
    (MARK + json.dumps([5]), "not an absolute path"),
    (MARK + json.dumps(["/" + "a" * 5000]), "not an absolute path"),
    (MARK + json.dumps(["/a"] * (MAX_PATHS + 1)), "at most"),
])
def test_a_list_that_is_not_absolute_paths_is_refused(output, problem):
    with pytest.raises(ValueError, match=problem):
        parse_files(output)
