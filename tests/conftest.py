"""Shared test fixtures: tiny random Gemma 4 checkpoints (built once per session) and a CLI runner."""

from __future__ import annotations

import hashlib
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from mtpkit.cli.app import main
from tests.fixtures.gemma4_tiny import BUILDERS

EXAMPLES = Path(__file__).resolve().parents[1] / "mtpkit" / "examples"


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """tiny(name) -> folder of a tiny checkpoint built by tests/fixtures/gemma4_tiny.py (read-only: copy to change)."""
    built: dict[str, Path] = {}
    root = tmp_path_factory.mktemp("tiny")

    def get(name: str) -> Path:
        if name not in built:
            built[name] = BUILDERS[name](root / name)
        return built[name]

    return get


@pytest.fixture
def tiny_copy(tiny, tmp_path):
    """tiny_copy(name) -> a private copy of a tiny checkpoint that a test may damage."""

    def get(name: str) -> Path:
        dest = tmp_path / f"{name}-copy"
        shutil.copytree(tiny(name), dest)
        return dest

    return get


def tree_digest(folder: Path) -> dict[str, str]:
    """sha256 of every file below `folder`, by relative path: proves bytes unchanged or identical."""
    return {
        p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*")) if p.is_file()
    }


@dataclass
class CliResult:
    code: int
    out: str
    err: str


def run_cli(capture, *args) -> CliResult:
    """`mtp-convert ARGS` in-process through the real entry point (error mapping included), its output read
    from `capture` (pytest's capsys, or capfd where a handler holds the real stderr)."""
    capture.readouterr()
    try:
        main([str(a) for a in args])
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    captured = capture.readouterr()
    return CliResult(code, captured.out, captured.err)


@pytest.fixture
def cli(capsys):
    """Run `mtp-convert ARGS` in-process (run_cli with capsys)."""
    return lambda *args: run_cli(capsys, *args)
