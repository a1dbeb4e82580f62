"""imagebuild rollout: move channel tags region by region (planning in rollout_plan.py, effects in rollout.py)."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from imagebuild.cli.common import exports_figures, record_figures, release_scope, reports_input_errors
from imagebuild.core.errors import ExitCode
from imagebuild.core.source import InputError

if TYPE_CHECKING:
    from imagebuild.rollout.reconciler import Runtime

DEFAULT_RELEASE = Path("release.yaml")
DEFAULT_STATE_DIR = Path(".imagebuild/rollouts")

release_option = click.option(
    "--release", "release_path", type=click.Path(dir_okay=False, path_type=Path), default=DEFAULT_RELEASE,
    show_default=True, help="The release file: regions, channels, waves and their gates.")
state_dir_option = click.option(
    "--state-dir", type=click.Path(file_okay=False, path_type=Path), default=DEFAULT_STATE_DIR, show_default=True,
    help="Local copy of the records and audit.jsonl (the state registry holds the truth).")


def _out(line: str) -> None:
    click.echo(line, err=True)


def _load(release_path: Path) -> Any:
    from imagebuild.config.release_file import load_release

    return load_release(release_path)


def _runtime(config: Any = None) -> Runtime:
    """The rollout.Runtime a caller put in click's context object (a test wrapper), else the defaults; with
    release.yaml's `notify:` targets as its notifier unless the caller gave one."""
    import dataclasses

    from imagebuild.rollout.reconciler import Runtime

    found = click.get_current_context().find_object(Runtime)
    runtime = found if found is not None else Runtime()
    if runtime.notify is None and config is not None and config.notify:
        from imagebuild.notify.send import Notifier

        runtime = dataclasses.replace(runtime, notify=Notifier(config.notify))
    return runtime


def _observed(config: Any) -> Runtime:
    """_runtime(), telling the command's metrics each channel's figures from the record the run leaves."""
    from dataclasses import replace

    waves = [wave.name for wave in config.waves]

    def on_record(record: Any) -> None:
        from imagebuild.metrics.figures import rollout_figures

        for channel in record.get("channels") or ():
            record_figures(rollout_figures(record, str(channel), waves), channel=str(channel))

    release_scope(config)
    return replace(_runtime(config), on_record=on_record)


def _finish(action: Any, runtime: Runtime | None = None) -> None:
    """Run a rollout action; its exit code ends the command, a RolloutError is one line `error: rollout: ...`
    and ends it with its own code. Notifications still in flight get what is left of their timeouts."""
    from imagebuild.rollout.plan import PlanError
    from imagebuild.rollout.state import RolloutError

    try:
        code = action()
    except PlanError as exc:
        raise InputError("--channel/--image", None, "", str(exc)) from None
    except RolloutError as exc:
        click.echo(f"error: rollout: {exc}", err=True)
        sys.exit(exc.exit_code)
    finally:
        if runtime is not None and runtime.notify is not None:
            runtime.notify.drain()
    sys.exit(code)


@click.group("rollout")
def rollout_group() -> None:
    """Staged rollout of an image to channel tags, region by region in waves, with gates.

    A rollout copies the image by digest (signatures included) into each region of a wave,
    verifies it there, has the region's nodes pull it where release.yaml lists them (`prepull:`;
    a node that cannot pull halts the rollout before any tag moves), records every channel
    tag's previous digest, moves the tags, then waits
    on the wave's gates (soak, signature, smoke, Prometheus, HTTP health, approval) before
    the next wave. Its record, lease and audit trail live in the release's state registry, so
    `status`, `resume` and `rollback` work from any machine or CI job.

    \b
    Exit codes: 0 done; 1 halted (a gate or check failed), aborted or failed; 2 bad input;
    3 a registry unreachable (the rollout halts naming the region); 4 the channel's lease is
    held by another rollout.

    \b
    Examples:
      imagebuild rollout start --release release.yaml --image 127.0.0.1:5000/imagebuild/paddle@sha256:... \\
          --channel stable --channel 2.6-gpu-cuda11.8
      imagebuild rollout start --variant paddle3.3.1-cpu-py3.11-debian12 --workdir work --channel stable
      imagebuild rollout status                       # the latest rollout of the release's channels
      imagebuild rollout status 20261201t053000-ab12cd --format json
      imagebuild rollout approve 20261201t053000-ab12cd --wave canary
      imagebuild rollout resume 20261201t053000-ab12cd   # after a crash, a halt, a registry outage
      imagebuild rollout abort 20261201t053000-ab12cd
      imagebuild rollout rollback 20261201t053000-ab12cd
      imagebuild rollout prepull-manifest --image REF@DIGEST | kubectl apply -f -   # warm a cluster's nodes
    """


def _variant_image(workdir: Path, variant_id: str) -> str:
    """The variant's repository@digest from the build report, refused unless gated and signed for that digest."""
    from imagebuild.core.report import BuildReport, GateStage, SignStage

    report_path = workdir / "build-report.json"
    report = BuildReport.read(report_path)
    variant = next((v for v in report.variants if v.id == variant_id), None)
    if variant is None:
        raise InputError(str(report_path), None, "variants", f"no variant '{variant_id}' in the build report")
    if not variant.image or not variant.digest:
        raise InputError(str(report_path), None, f"variants.{variant_id}", "not built (no digest recorded)")
    for kind, word in ((GateStage, "gated"), (SignStage, "signed")):
        if variant.stage_refusal(kind) is not None:
            from imagebuild.rollout.state import RolloutError

            raise RolloutError(f"refusing to roll out {variant.image}: the build report does not show it {word} "
                               f"for this digest (run imagebuild {'gate' if kind is GateStage else 'sign'})")
    return variant.image


@rollout_group.command("start")
@release_option
@click.option("--image", default=None, metavar="REF@DIGEST", help="The image to roll out, by digest (in staging).")
@click.option("--variant", "variant_id", default=None, metavar="ID", help="A variant of the build report in --workdir.")
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where build-report.json is (with --variant).")
@click.option("--channel", "channels", multiple=True, required=True, metavar="TAG",
              help="A channel tag to move (repeat); each must be listed under the release's channels.")
@state_dir_option
@reports_input_errors
@exports_figures("rollout")
def start_command(release_path: Path, image: str | None, variant_id: str | None, workdir: Path | None,
                  channels: tuple[str, ...], state_dir: Path) -> None:
    """Plan the waves and run them: copy, verify, move the tags, pass the gates, next wave.

    The image must verify in staging (signed, with the attestations the release's trust config
    requires) or nothing starts. Prints the rollout ID first; progress goes to stderr.
    """
    from imagebuild.rollout import reconciler as rollout

    if (image is None) == (variant_id is None):
        raise InputError("--image/--variant", None, "", "give either --image REF@DIGEST or --variant ID --workdir W")
    if variant_id is not None and workdir is None:
        raise InputError("--variant", None, "", "needs --workdir (where build-report.json is)")
    if image is not None and "@sha256:" not in image:
        raise InputError("--image", None, "", f"'{image[:100]}' is not by digest (REF@sha256:...)")
    config = _load(release_path)
    runtime = _observed(config)

    def action() -> int:
        source = image if image is not None else _variant_image(workdir or Path("."), variant_id or "")
        return rollout.start(config, source, channels, state_dir, _out, runtime)

    _finish(action, runtime)


def _rollout_id(rollout_id: str) -> str:
    import re

    if not re.fullmatch(r"[a-z0-9][a-z0-9-]{0,80}", rollout_id):
        raise InputError("ID", None, "", f"'{rollout_id[:80]}' is not a rollout ID")
    return rollout_id


@rollout_group.command("resume")
@click.argument("rollout_id", metavar="ID")
@release_option
@state_dir_option
@reports_input_errors
@exports_figures("rollout")
def resume_command(rollout_id: str, release_path: Path, state_dir: Path) -> None:
    """Finish a rollout from its recorded state (after a kill, a halt or an outage); no step runs twice."""
    from imagebuild.rollout import reconciler as rollout

    config = _load(release_path)
    runtime = _observed(config)
    _finish(lambda: rollout.resume(config, _rollout_id(rollout_id), state_dir, _out, runtime), runtime)


@rollout_group.command("abort")
@click.argument("rollout_id", metavar="ID")
@release_option
@state_dir_option
@reports_input_errors
@exports_figures("rollout")
def abort_command(rollout_id: str, release_path: Path, state_dir: Path) -> None:
    """Stop a rollout before its next step (tags already moved stay; `rollback` puts them back)."""
    from imagebuild.rollout import reconciler as rollout

    config = _load(release_path)
    runtime = _observed(config)
    _finish(lambda: rollout.abort(config, _rollout_id(rollout_id), state_dir, _out, runtime), runtime)


@rollout_group.command("approve")
@click.argument("rollout_id", metavar="ID")
@click.option("--wave", required=True, help="The wave whose approval gate this passes.")
@release_option
@state_dir_option
@reports_input_errors
def approve_command(rollout_id: str, wave: str, release_path: Path, state_dir: Path) -> None:
    """Pass a wave's manual approval gate (recorded in the audit trail with who approved)."""
    from imagebuild.rollout import reconciler as rollout

    config = _load(release_path)
    _finish(lambda: rollout.approve(config, _rollout_id(rollout_id), wave, state_dir, _out))


@rollout_group.command("rollback")
@click.argument("rollout_id", metavar="ID")
@release_option
@state_dir_option
@reports_input_errors
@exports_figures("rollout")
def rollback_command(rollout_id: str, release_path: Path, state_dir: Path) -> None:
    """Point every tag the rollout moved back at its recorded previous digest, last wave first.

    A tag the rollout created is deleted. A tag someone moved again since is left alone (and
    the audit trail says so). Resumable like the rollout itself.
    """
    from imagebuild.rollout import reconciler as rollout

    config = _load(release_path)
    runtime = _observed(config)
    _finish(lambda: rollout.rollback(config, _rollout_id(rollout_id), state_dir, _out, runtime), runtime)


@rollout_group.command("status")
@click.argument("rollout_id", metavar="[ID]", required=False)
@release_option
@click.option("--format", "output_format", type=click.Choice(["table", "json"]), default="table", show_default=True)
@click.option("--watch", is_flag=True, help="Redraw every 2 seconds until the rollout stops running.")
@reports_input_errors
def status_command(rollout_id: str | None, release_path: Path, output_format: str, watch: bool) -> None:
    """Per region and tag: the digest it points at now (read live), the previous one, the wave's state and gates."""
    from imagebuild.rollout import reconciler as rollout
    from imagebuild.rollout.state import RolloutError

    config = _load(release_path)

    def current() -> dict[str, Any]:
        wanted = _rollout_id(rollout_id) if rollout_id else rollout.latest_rollout(config, config.channels)
        if wanted is None:
            raise RolloutError("no rollout of this release's channels yet")
        return rollout.status(config, wanted)

    def show() -> dict[str, Any]:
        data = current()
        if output_format == "json":
            click.echo(json.dumps(data, indent=2, sort_keys=True))
        else:
            _print_status(data)
        return data

    def action() -> int:
        data = show()
        while watch and data["status"] in ("running", "rolling-back"):
            time.sleep(2)
            data = show()
        return ExitCode.OK if data["status"] in ("completed", "rolled-back", "running", "rolling-back") else ExitCode.FAILED

    _finish(action)


def _print_status(data: dict[str, Any]) -> None:
    """The table; free text of the record (reason, source, gate details) came from the state repository,
    so its control characters are escaped before they reach a terminal."""
    from imagebuild.core.source import safe_text
    from imagebuild.rollout.state import short

    reason = f" ({safe_text(data['reason'], 2000)})" if data.get("reason") else ""
    click.echo(f"rollout {data['id']}: {data['status']}{reason}")
    click.echo(f"  image {safe_text(data['source'], 300)}  channels {', '.join(data['channels'])}  "
               f"step {data['next_step']}/{data['steps']}")
    click.echo(f"  {'WAVE':<12} {'REGION':<12} {'TAG':<24} {'CURRENT':<14} {'PREVIOUS':<14} STATE")
    for row in data["tags"]:
        previous = short(row["previous"]) if row["previous_recorded"] else "(not recorded)"
        if row["previous_recorded"] and row["previous"] is None:
            previous = "(none)"
        current = "unreachable" if row["error"] else short(row["current"]) if row["current"] else "(none)"
        marker = " *" if row["at_rollout_digest"] else ""
        click.echo(f"  {row['wave']:<12} {row['region']:<12} {row['tag']:<24} {current:<14} {previous:<14} "
                   f"{row['wave_state']}{marker}")
    for wave, state in data["waves"].items():
        for gate in state.get("gates") or []:
            click.echo(f"  gate {wave}/{safe_text(gate.get('gate'), 100)}@{safe_text(gate.get('region'), 100)}: "
                       f"{safe_text(gate.get('outcome'), 100)}: {safe_text(gate.get('detail'), 500)}")
    click.echo("  (* = at this rollout's digest)")


@rollout_group.command("prepull-manifest")
@click.option("--image", required=True, metavar="REF@DIGEST", help="The image every node pulls, by digest.")
@click.option("--namespace", default="imagebuild-system", show_default=True, help="The DaemonSet's namespace.")
@click.option("--name", default=None, help="The DaemonSet's name [default: imagebuild-prepull-<digest prefix>].")
@click.option("--pause-image", default="registry.k8s.io/pause:3.9", show_default=True,
              help="What each pod runs once its image is pulled (pin it by digest in production).")
@click.option("--node-selector", "selectors", multiple=True, metavar="KEY=VALUE",
              help="Only nodes with this label (repeat), e.g. nvidia.com/gpu.present=true.")
@click.option("--command", "command_text", default="/bin/true", show_default=True,
              help="What the image's init container runs to exit at once (space-separated argv).")
@click.option("--format", "output_format", type=click.Choice(["yaml", "json"]), default="yaml", show_default=True)
@reports_input_errors
def prepull_manifest_command(image: str, namespace: str, name: str | None, pause_image: str,
                             selectors: tuple[str, ...], command_text: str, output_format: str) -> None:
    """Print a DaemonSet that makes every selected node pull IMAGE before its channel tag moves.

    Apply it once the image is copied into the region, wait until `kubectl rollout status`
    says every pod is ready (each node then holds the image), move the tag, delete the DaemonSet.
    For nodes reached through containerd directly, the rollout's own `prepull:` step does the same.

    \b
    Examples:
      imagebuild rollout prepull-manifest --image 127.0.0.1:5001/imagebuild-example/paddle@sha256:... \\
          --node-selector nvidia.com/gpu.present=true | kubectl apply -f -
      kubectl -n imagebuild-system rollout status daemonset/imagebuild-prepull-0123456789ab --timeout 15m
    """
    import yaml

    from imagebuild.oci.reference import ReferenceError
    from imagebuild.rollout.prepull import daemonset_manifest

    labels: dict[str, str] = {}
    for selector in selectors:
        key, equals, value = selector.partition("=")
        if not equals or not key:
            raise InputError("--node-selector", None, "", f"'{selector[:80]}' is not KEY=VALUE")
        labels[key] = value
    command = tuple(command_text.split())
    if not command:
        raise InputError("--command", None, "", "give the program the init container runs")
    try:
        manifest = daemonset_manifest(image, namespace=namespace, name=name, pause_image=pause_image,
                                      node_selector=labels, command=command)
    except ReferenceError as exc:
        raise InputError("--image", None, "", str(exc)) from None
    if output_format == "json":
        click.echo(json.dumps(manifest, indent=2, sort_keys=True))
    else:
        click.echo(yaml.safe_dump(manifest, sort_keys=False), nl=False)
