"""Output from untrusted data is printed safely: no value from a registry, an attestation, a YAML file
or an AdmissionReview can end a line, rewrite one, move the cursor or read differently than it is.

cli.common.safe is the one helper every command's printing goes through (source.UNSAFE_TEXT says
what it escapes); rich output also has its markup escaped (safe_markup), since `[link=...]` would
otherwise become an OSC 8 escape sequence.
"""
from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from hypothesis import given, settings
from hypothesis import strategies as st

from imagebuild.cli.common import safe, safe_cells, safe_lines, safe_markup
from imagebuild.cli.inspect_command import record_tree
from imagebuild.core.source import UNSAFE_TEXT

from .conftest import run_imagebuild
from .e2e.oci_servers import RecordingServer

FAKE_VERIFIED = "\x1b[2K\r\u2714 verified"  # clear the line, back to its start, print a reassuring lie
# What a terminal acts on: C0 (ESC, CR, BS, BEL, LF), DEL, C1 (CSI U+009B, OSC U+009D), the Unicode
# line breaks, bidirectional controls and invisible formatting characters.
HOSTILE = ["\x1b[31m", "\x1b]8;;http://evil\x07", "\r", "\b", "\x07", "\n", "\x7f", "\x9b2K", "\x9d0;t\x9c",
           "\u2028", "\u2029", "\u202e", "\u2066", "\u2069", "\u200b", "\u200f", "\u061c", "\ufeff", "\ud800"]


@pytest.mark.parametrize("hostile", HOSTILE)
def test_each_kind_of_control_is_written_as_a_visible_escape(hostile):
    out = safe(f"before{hostile}after")
    assert out.startswith("before") and out.endswith("after")
    assert not UNSAFE_TEXT.search(out)
    assert "\\" in out  # it is shown, not dropped: a reader sees that something was there


def test_the_fake_verified_line_is_shown_for_what_it_is():
    assert safe(FAKE_VERIFIED) == "\\x1b[2K\\r\u2714 verified"


def test_ordinary_text_is_left_alone():
    text = "127.0.0.1:5000/paddle:3.3.1 verified: sha256:ab (signed by ops; café, 日本, ✔, tabs\tno)"
    assert safe(text.replace("\t", " ")) == text.replace("\t", " ")
    assert safe("a\tb") == "a\\tb"


def test_a_limit_bounds_the_escaped_text():
    bounded = safe("\x1b" * 100, limit=20)
    assert len(bounded) == 20 and bounded.endswith("...") and "\x1b" not in bounded
    assert safe("x" * 50, limit=50) == "x" * 50


def test_lines_keep_their_breaks_but_nothing_else():
    assert safe_lines("step 1\n\x1b[2Kstep 2\r\nok") == "step 1\n\\x1b[2Kstep 2\nok"


@settings(max_examples=300, deadline=None, database=None)
@given(st.text())
def test_nothing_unsafe_survives_and_the_result_is_one_line(text):
    out = safe(text)
    assert not UNSAFE_TEXT.search(out)
    assert len(out.splitlines()) <= 1
    out.encode("utf-8")  # no lone surrogate left: it can be written to any UTF-8 terminal or log


def _render(renderable) -> str:
    from rich.console import Console

    buffer = io.StringIO()
    Console(file=buffer, force_terminal=True, color_system="truecolor", width=300, highlight=False).print(renderable)
    return buffer.getvalue()


def test_rich_markup_in_a_value_stays_text():
    out = _render(safe_markup("[link=http://evil.example]click[/link] [bold red]VERIFIED[/]"))
    assert "\x1b]8;" not in out  # no hyperlink escape
    assert "[link=http://evil.example]click[/link]" in out
    from rich.table import Table

    table = Table()
    table.add_column("a")
    table.add_column("b")
    table.add_row(*safe_cells("[/]", FAKE_VERIFIED))
    rendered = _render(table)
    assert "[/]" in rendered and "\\x1b[2K\\r" in rendered and "\x1b[2K" not in rendered


def test_the_release_record_tree_escapes_every_value():
    evil = FAKE_VERIFIED + "[link=http://evil]x[/link]"
    record = {
        "variant": evil, "matrix_cell": {"os": evil}, "matrix": {"path": evil, "sha256": evil},
        "base": {"image": evil, "digest": evil}, "source": {"uri": evil, "revision": evil},
        "layers": [{"kind": evil, "key": evil, "digest": evil}], "builder": evil,
        "build_run": {"id": evil, "started": evil, "finished": evil},
        "smoke": {"status": evil, "counts": {evil: 1}, "tiers": [evil]},
        "scan": {"scanner": {"uri": evil, "version": evil}, "db": {"version": evil, "uri": evil}, "started": evil},
        "gate": {"decision": evil, "policy": {"file": evil, "severity": evil}, "evaluated_on": evil,
                 "exceptions_applied": [{"id": evil, "package": evil, "expires": evil, "owner": evil, "reason": evil}],
                 "blocking": [{"id": evil, "package": evil, "severity": evil}]},
        "signature": {"layout": evil, "cosign": evil, "key": evil, "tlog": evil, "signature": evil,
                      "attestations": evil},
        "tags": [evil],
    }
    out = _render(record_tree(evil, evil, evil, record, verified=False))
    plain = re.sub(r"\x1b\[[0-9;]*m", "", out)  # rich's own colours are the only escapes left
    assert "\x1b[2K" not in out and "\r" not in out and "\x1b]8;" not in out
    assert plain.count("\\x1b[2K\\r\u2714 verified[link=http://evil]x[/link]") >= 30


# --- through the real CLI: a registry's error text ----------------------------------------------------


@pytest.fixture
def hostile_registry():
    """A loopback registry whose every answer is an error carrying an escape sequence in its message."""
    body = json.dumps({"errors": [{"code": "DENIED", "message": FAKE_VERIFIED}]}).encode()
    server = RecordingServer(default=(401, {"Content-Type": "application/json"}, body))
    yield server
    server.stop()


@pytest.fixture
def public_key(tmp_path: Path) -> Path:
    key = ec.generate_private_key(ec.SECP256R1()).public_key()
    path = tmp_path / "cosign.pub"
    path.write_bytes(key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    return path


@pytest.mark.parametrize("command", ["verify", "inspect"])
def test_a_registry_error_with_an_escape_sequence_is_printed_escaped(command, hostile_registry, public_key):
    image = f"{hostile_registry.host}/paddle@sha256:{'a' * 64}"
    result = run_imagebuild(command, "--key", public_key, image)
    assert result.returncode == 1, result.stderr
    assert "\x1b" not in result.stderr + result.stdout and "\r" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{image}: refused: ")
    assert lines[0].endswith("DENIED \\x1b[2K\\r\u2714 verified")
