"""Progress for people (a live display per layer on a terminal) and for CI logs (a line per event)."""
from __future__ import annotations

import sys
import threading
import time
from typing import Protocol, TextIO

from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TaskID, TextColumn, TimeElapsedColumn


class HasLayerFields(Protocol):
    # Read-only members: a record's status is a str subclass (an enum word), which a
    # settable protocol attribute of type str would not accept.
    @property
    def key(self) -> str: ...
    @property
    def path(self) -> str: ...
    @property
    def status(self) -> str: ...
    @property
    def digest(self) -> str | None: ...
    @property
    def duration_s(self) -> float | None: ...


class LineProgress:
    """One plain line per event, for logs that are not a terminal."""

    def __init__(self, stream: TextIO | None = None):
        self.stream = stream or sys.stderr
        self.lock = threading.Lock()

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def add(self, rec: HasLayerFields) -> None:
        pass

    def __call__(self, event: str, rec: HasLayerFields) -> None:
        detail = ""
        if rec.duration_s is not None:
            detail += f" in {rec.duration_s:.1f}s"
        if rec.digest and event in ("built", "reused"):
            detail += f" {rec.digest[:19]}"
        with self.lock:
            print(f"{time.strftime('%H:%M:%S')} {event:8} {rec.path} ({rec.key[:8]}){detail}",
                  file=self.stream, flush=True)


class LiveProgress:
    """A spinner and elapsed time per layer being built, on a terminal."""

    def __init__(self, console: Console):
        self.progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                                 TextColumn("{task.fields[status]}"), TimeElapsedColumn(),
                                 console=console, transient=False)
        self.tasks: dict[str, TaskID] = {}

    def __enter__(self) -> LiveProgress:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def add(self, rec: HasLayerFields) -> None:
        self.tasks[rec.key] = self.progress.add_task(rec.path, total=1, status="waiting", start=False)

    def __call__(self, event: str, rec: HasLayerFields) -> None:
        task = self.tasks.get(rec.key)
        if task is None:
            return
        if event == "building":
            self.progress.start_task(task)
        done = event in ("built", "failed", "skipped")
        self.progress.update(task, status=event, completed=1 if done else 0)
        if done:
            self.progress.stop_task(task)


def progress_for(console: Console) -> LineProgress | LiveProgress:
    return LiveProgress(console) if console.is_terminal else LineProgress()
