"""One error root, one table of exit codes, one place that ends a command with them.

Every exception imagebuild defines is an `ImagebuildError` and carries the exit code it means
(`imagebuild/core/errors.py`); `cli/common.reports_input_errors` ends every command with the
error's own code, in one line on stderr. Signals are not errors: a Ctrl-C or a CI cancel stays a
KeyboardInterrupt, so no `except Exception` ever swallows it.
"""
from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
import signal
from pathlib import Path

import click
import pytest
from click.testing import CliRunner, Result

import imagebuild
from imagebuild.build.baseimage import BaseImageError, SourcesError, ToolMissingError
from imagebuild.build.baseimage import main as baseimage_main
from imagebuild.cli import cli, common
from imagebuild.core.errors import ExitCode, ImagebuildError, exit_code_of
from imagebuild.core.runner import Cancelled, ToolMissing
from imagebuild.core.source import InputError
from imagebuild.kube.client import KubeConflict, KubeError
from imagebuild.oci.auth import AuthDenied, CredentialError, RealmRefused
from imagebuild.oci.client import RegistryAuthError, RegistryError, RegistryUnreachable
from imagebuild.release.harbor import HarborAuthError, HarborError, HarborUnavailable
from imagebuild.release.push import PushError
from imagebuild.rollout import reconciler, rescan
from imagebuild.rollout.plan import PlanError
from imagebuild.rollout.state import LeaseHeld, RolloutError, StateRefused

from .conftest import REPO_ROOT, run_imagebuild
from .test_release import VALID as VALID_RELEASE

DIGEST = "sha256:" + "ab" * 32
UNREACHABLE = "127.0.0.1:1"  # nothing listens on port 1: connection refused at once


def defined_exceptions() -> list[type[BaseException]]:
    """Every exception class defined in imagebuild/, found by importing every module."""
    found: dict[str, type[BaseException]] = {}
    for module_info in pkgutil.walk_packages(imagebuild.__path__, "imagebuild."):
        if module_info.name.endswith(".__main__"):  # runs the CLI when imported
            continue
        module = importlib.import_module(module_info.name)
        for _, value in inspect.getmembers(module, inspect.isclass):
            if issubclass(value, BaseException) and value.__module__ == module.__name__:
                found[f"{value.__module__}.{value.__qualname__}"] = value
    return [found[name] for name in sorted(found)]


EXCEPTIONS = defined_exceptions()
SIGNALS = [cls for cls in EXCEPTIONS if issubclass(cls, KeyboardInterrupt)]
ERRORS = [cls for cls in EXCEPTIONS if cls not in SIGNALS]


# --- the root --------------------------------------------------------------------------------------


def test_the_walk_finds_the_package_s_exceptions():
    names = {cls.__name__ for cls in EXCEPTIONS}
    assert len(EXCEPTIONS) >= 40
    assert {"InputError", "ToolMissing", "RegistryError", "RolloutError", "LeaseHeld", "_Halt", "Refusal",
            "Refused", "HarborUnavailable", "SourcesError"} <= names


@pytest.mark.parametrize("cls", ERRORS, ids=lambda cls: f"{cls.__module__}.{cls.__qualname__}")
def test_every_exception_imagebuild_defines_is_an_imagebuild_error(cls):
    assert issubclass(cls, ImagebuildError)
    assert isinstance(cls.exit_code, ExitCode)


def test_signals_are_not_errors():
    """Cancelled (SIGTERM, SIGINT) stays a KeyboardInterrupt: `except Exception` must never catch a cancel."""
    assert SIGNALS == [Cancelled]
    assert not issubclass(Cancelled, Exception)
    assert exit_code_of(Cancelled(signal.SIGTERM)) == ExitCode.TERMINATED
    assert exit_code_of(Cancelled(signal.SIGINT)) == ExitCode.INTERRUPTED
    assert exit_code_of(KeyboardInterrupt()) == ExitCode.INTERRUPTED


FORMER_VALUE_ERRORS = ("ReferenceError", "HostError", "RepositoryError", "TagError", "DigestError", "BadName",
                       "ReportError", "PrometheusAnswerError", "PlanError", "RecordMismatch", "PredicateError")


@pytest.mark.parametrize("name", FORMER_VALUE_ERRORS)
def test_value_errors_stay_value_errors(name):
    """`except ValueError` (where a caller turns a bad value into an InputError) still catches them."""
    (cls,) = [cls for cls in EXCEPTIONS if cls.__name__ == name]
    assert issubclass(cls, ImagebuildError) and issubclass(cls, ValueError)


def test_the_exit_codes():
    assert {code.name: int(code) for code in ExitCode} == {
        "OK": 0, "FAILED": 1, "BAD_INPUT": 2, "ENVIRONMENT": 3, "LEASE_HELD": 4, "INTERRUPTED": 130,
        "TERMINATED": 143,
    }


# What each error means when it ends a command. Every class not named here means FAILED.
MEANS = {
    InputError: ExitCode.BAD_INPUT,
    PlanError: ExitCode.BAD_INPUT,  # `rollout` reports it as `--channel/--image` bad input
    SourcesError: ExitCode.BAD_INPUT,  # python -m imagebuild.build.baseimage
    ToolMissing: ExitCode.ENVIRONMENT,
    ToolMissingError: ExitCode.ENVIRONMENT,
    RegistryError: ExitCode.ENVIRONMENT,  # whatever the registry said, as the CLI has always ended it
    RegistryUnreachable: ExitCode.ENVIRONMENT,
    RegistryAuthError: ExitCode.ENVIRONMENT,
    CredentialError: ExitCode.ENVIRONMENT,  # the client raises it on as a RegistryAuthError
    AuthDenied: ExitCode.ENVIRONMENT,  # likewise
    RealmRefused: ExitCode.ENVIRONMENT,
    HarborUnavailable: ExitCode.ENVIRONMENT,
    HarborAuthError: ExitCode.ENVIRONMENT,
    reconciler._RegionDown: ExitCode.ENVIRONMENT,  # retried, then the rollout halts with 3
    KubeError: ExitCode.ENVIRONMENT,  # the lease's cluster is unreachable or refuses: what RegistryError is
    KubeConflict: ExitCode.ENVIRONMENT,  # a 409 the lease does not turn into LeaseHeld itself
    LeaseHeld: ExitCode.LEASE_HELD,
}


@pytest.mark.parametrize("cls", ERRORS, ids=lambda cls: f"{cls.__module__}.{cls.__qualname__}")
def test_each_error_carries_the_code_it_means(cls):
    assert cls.exit_code == MEANS.get(cls, ExitCode.FAILED)


@pytest.mark.parametrize("cls", [ImagebuildError, HarborError, BaseImageError, RolloutError, StateRefused, PushError])
def test_errors_that_mean_the_work_failed(cls):
    assert cls.exit_code == ExitCode.FAILED


def test_an_instance_may_carry_its_own_code():
    assert RolloutError("staging registry unreachable").exit_code == ExitCode.FAILED
    assert RolloutError("staging registry unreachable", ExitCode.ENVIRONMENT).exit_code == ExitCode.ENVIRONMENT
    assert ImagebuildError("held", exit_code=ExitCode.LEASE_HELD).exit_code == ExitCode.LEASE_HELD
    assert RolloutError.exit_code == ExitCode.FAILED  # the instance's code is its own, not its class's
    assert str(RolloutError("the message", ExitCode.BAD_INPUT)) == "the message"
    assert exit_code_of(RuntimeError("not ours")) == ExitCode.FAILED


# --- the one place: reports_input_errors ----------------------------------------------------------


@pytest.fixture
def in_process(monkeypatch) -> list[str]:
    """Commands run inside pytest: no signal handlers of imagebuild's in this process, no report note,
    and stopping the children is only counted (the real one would leave this process cancelled)."""
    stopped: list[str] = []
    monkeypatch.setattr(common, "install_signal_handlers", lambda: None)
    monkeypatch.setattr(common, "cancel_children", lambda: stopped.append("children"))
    monkeypatch.setattr(common, "_stage_report", {})
    monkeypatch.delenv("IMAGEBUILD_DEBUG", raising=False)
    return stopped


def ends(error: BaseException) -> Result:
    @click.command("stage")
    @common.reports_input_errors
    def command() -> None:
        raise error

    return CliRunner().invoke(command, [])


@pytest.mark.parametrize("error, code, line, stops_children", [
    (InputError("matrix.yaml", 3, "variants", "not a list"), 2, "error: matrix.yaml:3: variants: not a list", False),
    (ToolMissing("trivy not found on PATH"), 3, "error: trivy not found on PATH", False),
    (RegistryUnreachable("127.0.0.1:1/a: HEAD manifest: ConnectError"), 3,
     "error: registry: 127.0.0.1:1/a: HEAD manifest: ConnectError", False),
    (RegistryError("127.0.0.1:5000/a: GET manifest: 404"), 3, "error: registry: 127.0.0.1:5000/a: GET manifest: 404",
     False),
    (LeaseHeld("channel 'stable' is being rolled out"), 4,
     "error: stage: LeaseHeld: channel 'stable' is being rolled out", True),
    (RolloutError("staging registry unreachable", ExitCode.ENVIRONMENT), 3,
     "error: stage: RolloutError: staging registry unreachable", True),
    (PushError("the copy broke off"), 1, "error: stage: PushError: the copy broke off", True),
    (ImagebuildError("odd", exit_code=ExitCode.BAD_INPUT), 2, "error: stage: ImagebuildError: odd", True),
    (RuntimeError("boom"), 1, "error: stage: RuntimeError: boom", True),
    (KeyboardInterrupt(), 130, "interrupted by SIGINT: stage stopped, its running tools with it", True),
    (Cancelled(signal.SIGTERM), 143, "interrupted by SIGTERM: stage stopped, its running tools with it", True),
], ids=lambda value: type(value).__name__ if isinstance(value, BaseException) else None)
def test_a_command_ends_with_the_error_s_code_and_one_line(in_process, error, code, line, stops_children):
    result = ends(error)
    assert result.exit_code == code
    assert result.stderr == line + "\n"
    assert in_process == (["children"] if stops_children else [])


def test_the_line_is_made_safe(in_process):
    result = ends(RegistryError("registry said \x1b[2Kok"))
    assert result.exit_code == 3
    assert result.stderr == "error: registry: registry said \\x1b[2Kok\n"


# --- real commands ---------------------------------------------------------------------------------


def test_ok(tmp_path):
    run = run_imagebuild("validate", "--matrix", REPO_ROOT / "matrix.yaml")
    assert run.returncode == ExitCode.OK, run.stderr


def test_a_malformed_matrix_is_bad_input(tmp_path):
    matrix = tmp_path / "matrix.yaml"
    matrix.write_text("schema: [\n", encoding="utf-8")
    run = run_imagebuild("validate", "--matrix", matrix)
    assert run.returncode == ExitCode.BAD_INPUT
    assert run.stderr.startswith(f"error: {matrix}:2: invalid YAML")
    assert len(run.stderr.splitlines()) == 1


def release_file(tmp_path: Path) -> Path:
    path = tmp_path / "release.yaml"
    path.write_text(VALID_RELEASE, encoding="utf-8")
    return path


def test_a_channel_the_release_does_not_list_is_bad_input(tmp_path):
    """rollout's PlanError, before any registry is asked."""
    run = run_imagebuild("rollout", "start", "--release", release_file(tmp_path), "--image",
                         f"127.0.0.1:5000/imagebuild/paddle@{DIGEST}", "--channel", "nope",
                         "--state-dir", tmp_path / "state")
    assert run.returncode == ExitCode.BAD_INPUT
    assert run.stderr == ("error: --channel/--image: channel 'nope' is not among the release's channels "
                          "(2.6-gpu-cuda11.8, stable)\n")


def public_key(tmp_path: Path) -> Path:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1()).public_key()
    path = tmp_path / "cosign.pub"
    path.write_bytes(key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    return path


def test_an_unreachable_registry_is_the_environment(tmp_path):
    """promote lets the RegistryUnreachable through; the CLI ends it with 3 and `error: registry: ...`."""
    run = run_imagebuild("promote", f"{UNREACHABLE}/imagebuild/paddle:3.3.1", f"{UNREACHABLE}/release",
                         "--key", public_key(tmp_path), "--workdir", tmp_path / "work")
    assert run.returncode == ExitCode.ENVIRONMENT, run.stderr
    assert run.stderr.startswith(f"error: registry: {UNREACHABLE}/imagebuild/paddle: ")
    assert "Connection refused" in run.stderr and len(run.stderr.splitlines()) == 1


def test_verify_of_an_unreachable_registry_is_the_environment(tmp_path):
    run = run_imagebuild("verify", "--key", public_key(tmp_path), f"{UNREACHABLE}/imagebuild/paddle:3.3.1")
    assert run.returncode == ExitCode.ENVIRONMENT, run.stderr
    assert run.stderr.startswith(f"{UNREACHABLE}/imagebuild/paddle:3.3.1: registry unreachable: ")


def test_an_unreachable_harbor_is_the_environment():
    run = run_imagebuild("harbor", "scan-overview", "--url", f"http://{UNREACHABLE}", "--retries", "0",
                         f"paddle/paddle@{DIGEST}", env={"HARBOR_USERNAME": "admin", "HARBOR_PASSWORD": "pw"})
    assert run.returncode == ExitCode.ENVIRONMENT, run.stderr
    assert run.stderr.startswith(f"error: harbor: cannot reach Harbor at http://{UNREACHABLE} ")


def test_a_missing_vulnerability_db_is_the_environment(tmp_path):
    """ToolMissing: rescan --offline finds no DB in its cache (or no trivy at all)."""
    (tmp_path / "cache").mkdir()
    run = run_imagebuild("rescan", "--release", release_file(tmp_path), "--offline", "--cache-dir", tmp_path / "cache",
                         "--out", tmp_path / "out", "--state-dir", tmp_path / "state")
    assert run.returncode == ExitCode.ENVIRONMENT, run.stderr
    assert run.stderr.startswith("error: ") and len(run.stderr.splitlines()) == 1


def rollout_start(tmp_path: Path) -> Result:
    return CliRunner().invoke(cli, ["rollout", "start", "--release", str(release_file(tmp_path)), "--image",
                                    f"127.0.0.1:5000/imagebuild/paddle@{DIGEST}", "--channel", "stable",
                                    "--state-dir", str(tmp_path / "state")])


@pytest.mark.parametrize("outcome, code, line", [
    (LeaseHeld("channel 'stable' is being rolled out: rollout r1 (alice@ci)"), 4,
     "error: rollout: channel 'stable' is being rolled out: rollout r1 (alice@ci)\n"),
    (RolloutError("staging registry unreachable: ConnectError", ExitCode.ENVIRONMENT), 3,
     "error: rollout: staging registry unreachable: ConnectError\n"),
    (RolloutError("refusing to roll out IMAGE: it does not verify in staging"), 1,
     "error: rollout: refusing to roll out IMAGE: it does not verify in staging\n"),
    (ExitCode.FAILED, 1, ""),  # halted: the reconciler says why on stderr as it goes
    (ExitCode.OK, 0, ""),
], ids=["lease-held", "unreachable", "refused", "halted", "done"])
def test_a_rollout_ends_with_its_code(in_process, monkeypatch, tmp_path, outcome, code, line):
    def start(*_args, **_kwargs):
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    monkeypatch.setattr(reconciler, "start", start)
    result = rollout_start(tmp_path)
    assert result.exit_code == code
    assert result.stderr == line


def test_rescan_ends_a_rollout_error_with_1_as_it_always_has(in_process, monkeypatch, tmp_path):
    """A region whose credentials variable is unset: `rollout` says bad input (2); rescan has ended
    such a run with 1, as for any failure it does not name, and still does."""
    def fails(*_args, **_kwargs):
        raise RolloutError("region us-east: environment variable US_EAST_REGISTRY_AUTH must hold USER:PASSWORD",
                           ExitCode.BAD_INPUT)

    monkeypatch.setattr(rescan, "rescan", fails)
    result = CliRunner().invoke(cli, ["rescan", "--release", str(release_file(tmp_path)), "--policy",
                                      str(REPO_ROOT / "policies" / "vulnerabilities.yaml"), "--out",
                                      str(tmp_path / "out"), "--state-dir", str(tmp_path / "state")])
    assert result.exit_code == ExitCode.FAILED
    assert result.stderr == ("error: rescan: RolloutError: region us-east: environment variable "
                             "US_EAST_REGISTRY_AUTH must hold USER:PASSWORD\n")


def test_the_base_image_tool_ends_with_the_error_s_code(tmp_path, monkeypatch, capsys):
    """python -m imagebuild.build.baseimage: an apt configuration without the suite is bad input."""
    monkeypatch.delenv("IMAGEBUILD_BASE_MIRROR", raising=False)
    assert baseimage_main(["sources", "--apt-dir", str(tmp_path)]) == ExitCode.BAD_INPUT
    assert capsys.readouterr().err.startswith("error: no apt source for 'bookworm'")


def test_no_command_spells_a_code_as_a_number():
    """Exit codes are ExitCode members: no `sys.exit(2)`, no EXIT_* constants of a module's own
    (core/runner.py's EXIT_TIMED_OUT and EXIT_CANCELLED are a child process's codes, not ours)."""
    offenders = []
    for path in sorted((REPO_ROOT / "imagebuild").rglob("*.py")):
        for number, text in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if re.search(r"sys\.exit\([^)]*\b\d+\b", text) or ("EXIT_" in text and path.name != "runner.py"):
                offenders.append(f"{path.relative_to(REPO_ROOT)}:{number}: {text.strip()}")
    assert offenders == []
