"""Shared output helpers: rich consoles for stdout (results) and stderr (diagnostics), and progress."""

from __future__ import annotations

from contextlib import contextmanager
from collections.abc import Iterator

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

out = Console(soft_wrap=True)
err = Console(stderr=True, soft_wrap=True)


def warn(message: str) -> None:
    err.print(f"warning: {message}", markup=False, highlight=False)


@contextmanager
def byte_progress(description: str, total: int) -> Iterator:
    """A progress bar on stderr counting bytes; silent when stderr is not a terminal."""
    progress = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                        TimeRemainingColumn(), console=err, transient=True, disable=not err.is_terminal)
    with progress:
        task = progress.add_task(description, total=total)
        yield lambda n: progress.advance(task, n)


@contextmanager
def phase_progress() -> Iterator:
    """One progress bar per phase (calibrating, quantizing, evaluating) on stderr; silent when not a terminal.

    Yields the callbacks mtpkit.calibrate.pipeline.Progress takes.
    """
    from mtpkit.calibrate.pipeline import Progress as Callbacks

    progress = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
                         TimeRemainingColumn(), console=err, transient=True, disable=not err.is_terminal)
    current = {}

    def start(what: str, total: int) -> None:
        if "task" in current:
            progress.update(current["task"], visible=False)
        current["task"] = progress.add_task(what, total=total)

    with progress:
        yield Callbacks(start=start, advance=lambda n: progress.advance(current["task"], n))
