"""Where a run's figures go: a node-exporter textfile, a Pushgateway, or both, as the user configures.

A textfile is written whole and renamed into place (node-exporter's textfile collector may read the
directory at any moment: it must never see half a file). A push is one PUT of the Prometheus text format
to the Pushgateway's group (`/metrics/job/<job>/<label>/<value>...`), which replaces what that group held,
through the one retry policy; a Pushgateway that is down costs at most `timeout_s` and a warning, never
the run: the run's own exit code is what CI acts on.
"""
from __future__ import annotations

import base64
import os
import re
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric

from imagebuild.core.errors import ImagebuildError
from imagebuild.metrics.figures import Family
from imagebuild.oci.retry import RetryingTransport, RetryPolicy

TEXTFILE_ENV = "IMAGEBUILD_METRICS_TEXTFILE_DIR"
PUSHGATEWAY_ENV = "IMAGEBUILD_METRICS_PUSHGATEWAY"
# A push is a few KB to a service next to CI: a blip is retried, an outage given up within seconds.
PUSH_RETRIES = RetryPolicy(attempts=3, base_delay_s=0.2, max_delay_s=1.0, max_elapsed_s=3.0, max_retry_after_s=2.0)
_PLAIN = re.compile(r"[A-Za-z0-9_.~-]+")
_LABEL = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


class MetricsExportError(ImagebuildError):
    """The figures could not be written or pushed (the caller warns; the run's result stands)."""


@dataclass(frozen=True)
class MetricsTarget:
    """Where figures go: a textfile collector's directory and/or a Pushgateway's base URL (None: not there)."""

    textfile_dir: Path | None = None
    pushgateway: str | None = None
    timeout_s: float = 5.0

    @property
    def enabled(self) -> bool:
        return self.textfile_dir is not None or self.pushgateway is not None

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] = os.environ) -> MetricsTarget:
        directory = environ.get(TEXTFILE_ENV) or None
        return cls(Path(directory) if directory else None, environ.get(PUSHGATEWAY_ENV) or None)


class _Figures:
    """A prometheus_client collector of ready-made families (the text format is the client's, not ours)."""

    def __init__(self, families: Sequence[Family]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        for family in self._families:
            names = sorted({name for sample in family.samples for name, _ in sample.labels})
            metric = GaugeMetricFamily(family.full_name, family.help, labels=names)
            for sample in family.samples:
                values = dict(sample.labels)
                metric.add_metric([values.get(name, "") for name in names], sample.value)
            yield metric


def exposition(families: Iterable[Family], labels: Mapping[str, str] | None = None) -> bytes:
    """The Prometheus text format of `families`, each sample also carrying `labels`."""
    extra = tuple(sorted((labels or {}).items()))
    merged = []
    for family in families:
        if not family.samples:
            continue  # a family with no sample says nothing, and an empty HELP line only confuses readers
        copy = Family(family.name, family.help)
        for sample in family.samples:
            copy.samples.append(type(sample)(tuple(sorted({**dict(extra), **dict(sample.labels)}.items())),
                                             sample.value))
        merged.append(copy)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Figures(merged))
    return generate_latest(registry)


def textfile_name(job: str, grouping: Mapping[str, str], suffix: str = "") -> str:
    """One file per job and group, so that runs of other groups never overwrite it."""
    parts = [job, *(f"{key}-{value}" for key, value in sorted(grouping.items()))]
    return re.sub(r"[^A-Za-z0-9_.-]", "_", "_".join(parts))[:200] + suffix + ".prom"


def write_textfile(directory: Path, job: str, grouping: Mapping[str, str], families: Iterable[Family],
                   suffix: str = "") -> Path:
    """Write the figures for node-exporter's textfile collector, whole or not at all."""
    target = directory / textfile_name(job, grouping, suffix)
    data = exposition(families, grouping)  # no job label: the scrape of node-exporter gives its own
    try:
        directory.mkdir(parents=True, exist_ok=True)
        # The collector reads only *.prom: the temporary name is not one, so a half-written file is never read.
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".imagebuild-", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(data)
            os.chmod(tmp, 0o644)
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as err:
        raise MetricsExportError(f"cannot write {target}: {err.strerror or err}") from None
    return target


def group_url(base: str, job: str, grouping: Mapping[str, str]) -> str:
    """The Pushgateway URL of a group: a value that is not plain (a slash, a space, empty) goes base64url."""
    path = ["metrics", *_pair("job", job)]
    for key, value in sorted(grouping.items()):
        if not _LABEL.fullmatch(key):
            raise MetricsExportError(f"'{key[:60]}' is not a Prometheus label name")
        path += _pair(key, value)
    return base.rstrip("/") + "/" + "/".join(path)


def _pair(key: str, value: str) -> list[str]:
    if _PLAIN.fullmatch(value):
        return [key, value]
    return [f"{key}@base64", base64.urlsafe_b64encode(value.encode()).decode().rstrip("=") or "="]


def push(base: str, job: str, grouping: Mapping[str, str], families: Iterable[Family], timeout_s: float = 5.0,
         replace: bool = True, transport: httpx.BaseTransport | None = None) -> None:
    """Replace the group's metrics on the Pushgateway (PUT), or only those named here (POST, `replace=False`);
    MetricsExportError when it does not take them."""
    url = group_url(base, job, grouping)
    data = exposition(families)
    retrying = RetryingTransport(transport or httpx.HTTPTransport(), PUSH_RETRIES)
    try:
        with httpx.Client(transport=retrying, timeout=timeout_s) as client:
            response = client.request("PUT" if replace else "POST", url, content=data,
                                      headers={"Content-Type": "text/plain; version=0.0.4"})
    except httpx.HTTPError as err:
        raise MetricsExportError(f"cannot push to {_shown(base)}: {type(err).__name__}") from None
    if response.status_code // 100 != 2:
        raise MetricsExportError(f"{_shown(base)} refused the push: HTTP {response.status_code} "
                                 f"{response.text[:200].strip()}")


def _shown(base: str) -> str:
    """The Pushgateway as a message names it: scheme, host and port, never credentials in the URL."""
    try:
        url = httpx.URL(base)
    except httpx.InvalidURL:
        return "the Pushgateway"
    return f"{url.scheme}://{url.host}" + (f":{url.port}" if url.port else "")


def export(target: MetricsTarget, job: str, grouping: Mapping[str, str], figures: Sequence[Family],
           run: Sequence[Family], warn: Callable[[str], None]) -> list[str]:
    """One group's figures and how the run ended, to every place the target names; where each went.

    A run that has no figures (it stopped before it had any) must not wipe the last run's: then only the
    run's own figures are written (textfile: its own `.run.prom` file; Pushgateway: a POST, which replaces
    only the metrics it names, where a PUT replaces the whole group)."""
    done = []
    if target.textfile_dir is not None:
        try:
            if figures:
                done.append(str(write_textfile(target.textfile_dir, job, grouping, figures)))
            done.append(str(write_textfile(target.textfile_dir, job, grouping, run, suffix=".run")))
        except MetricsExportError as err:
            warn(f"metrics: {err}")
    if target.pushgateway is not None:
        try:
            push(target.pushgateway, job, grouping, [*figures, *run], target.timeout_s, replace=bool(figures))
            done.append(group_url(_shown(target.pushgateway), job, grouping))
        except MetricsExportError as err:
            warn(f"metrics: {err}")
    return done
