"""Typed errors. The library raises these; the CLI turns each into one line on stderr and exit code 2.

Every error carries the place it is about (a file, key or tensor) and a fix, so the message a user
reads says what went wrong, where, and what to do next.
"""

from __future__ import annotations

from pathlib import Path


class MtpkitError(Exception):
    """Base class of every error mtpkit raises on bad input or a refused operation."""

    exit_code = 2  # what the CLI exits with

    def __init__(self, what: str, *, where: str | Path | None = None, fix: str | None = None):
        self.what = what
        self.where = str(where) if where is not None else None
        self.fix = fix
        super().__init__(self.one_line())

    def one_line(self) -> str:
        text = f"{self.where}: {self.what}" if self.where else self.what
        if self.fix:
            text += f"; {self.fix}"
        return text


class SourceNotFoundError(MtpkitError):
    """A local folder does not exist, or a Hub repository could not be resolved."""


class ConfigError(MtpkitError):
    """config.json (or another JSON file) is missing, unreadable, or holds values mtpkit cannot use."""


class UnsupportedModelError(ConfigError):
    """The checkpoint is not a Gemma 4 target or assistant."""


class CheckpointError(MtpkitError):
    """The tensor files are corrupt, inconsistent, or refused (pickles)."""


class PickleRefusedError(CheckpointError):
    """Only pickle weights (.bin/.pt/.pth/.ckpt) were found: mtpkit never unpickles."""


class OutputError(MtpkitError):
    """The destination cannot be written (it exists, lies inside the source, or a write failed)."""


class PairCheckError(MtpkitError):
    """The pair was readable but failed validation; `findings` holds the check results.

    Exit code 1, as `check` uses for errors (2 stays for unusable input).
    """

    exit_code = 1

    def __init__(self, what: str, *, findings: list, where: str | Path | None = None, fix: str | None = None):
        self.findings = findings
        super().__init__(what, where=where, fix=fix)


class InsufficientMemoryError(MtpkitError):
    """The device lacks the memory a model needs (estimated before anything is loaded)."""
