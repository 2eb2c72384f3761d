"""A corpus of bad inputs, each run through BOTH `mtp-convert inspect SRC` and `mtp-convert reshard SRC OUT`.

Every case damages a private copy of a tiny checkpoint in one way. The contract checked for each:
exit code 2; stderr is exactly one line, starting with "mtp-convert: error: ", naming the offending
file / folder / key, with no traceback; stdout is empty; no OUT folder and no hidden temporary folder
beside it; the input folder byte-identical before and after.

Oracles: where a case is a corrupt safetensors file, the reference library (`safetensors.safe_open`,
then reading every tensor) must reject it too, so the file really is invalid; `test_reference_accepts_*`
proves that oracle does accept a sound file. `test_pristine_inputs_succeed` proves every base input
passes both commands before it is damaged, so each failure below is caused by the damage alone.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors
import torch

from tests.conftest import tree_digest
from tests.convert.bad_input_cases import CASES, SHARDED_SIZE, Case, Env, Setup, _edit_config, reference_reads

PREFIX = "mtp-convert: error: "


def reference_rejects(path: Path) -> None:
    """The oracle: the reference safetensors library refuses to open or read `path`."""
    with pytest.raises(Exception):
        with safetensors.safe_open(str(path), "pt") as f:
            for key in f.keys():
                f.get_tensor(key)


def names_path(line: str, path: Path) -> bool:
    """`path` appears in `line` as a whole path (not as the prefix of a longer one, e.g. X.index.json)."""
    return re.search(re.escape(str(path)) + r"(?![\w.\-/])", line) is not None


def leftovers(out: Path) -> list[str]:
    """Hidden temporary folders beside OUT (the atomic writer's `.OUT.mtpkit-tmp-*`)."""
    if not out.parent.is_dir():
        return []
    return sorted(p.name for p in out.parent.iterdir() if "mtpkit-tmp" in p.name)



PARAMS = [pytest.param(case, command, id=f"{case.id}-{command}") for case in CASES for command in case.commands]


# ------------------------------------------------------------------------------------------------- tests


@pytest.fixture
def env(tmp_path, tiny_copy, monkeypatch):
    monkeypatch.delenv("MTPKIT_DEBUG", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a path mistaken for a repo id must never reach the network
    return Env(tmp_path, tiny_copy)


@pytest.fixture
def no_unpickling(monkeypatch):
    """mtpkit must never unpickle: any call fails loudly (the CLI would then report an internal error, exit 1)."""

    def refuse(*args, **kwargs):
        raise AssertionError("mtpkit tried to unpickle a file")

    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)


def _argv(command: str, setup: Setup, out: Path) -> list:
    if command == "inspect":
        return ["inspect", setup.src]
    return ["reshard", setup.src, out, *setup.args]


def _watched(src: Path) -> Path | None:
    """The input folder whose bytes must not change (a file given as SRC: the folder holding it)."""
    if src.is_dir():
        return src
    return src.parent if src.is_file() else None


def _check_refusal(result, setup: Setup, out: Path, watched: Path | None, before_src, before_out,
                   command: str) -> None:
    assert result.code == 2, (result.code, result.err)
    assert result.out == ""
    assert "Traceback" not in result.err
    assert result.err.endswith("\n") and len(result.err.splitlines()) == 1, repr(result.err)
    line = result.err.rstrip("\n")
    assert line.startswith(PREFIX), line
    for name in setup.names:
        if isinstance(name, Path):
            assert names_path(line, name), f"{line!r} does not name {name}"
        else:
            assert name in line, f"{line!r} does not name {name!r}"
    for wrong in setup.absent:
        assert wrong not in line, f"{line!r} names {wrong!r}, which does not exist"
    # The input is untouched, and nothing is left behind.
    if watched is not None:
        assert tree_digest(watched) == before_src
    else:
        assert not setup.src.exists()
    if command == "reshard":
        if setup.out_preexists:
            assert tree_digest(out) == before_out
        elif out != setup.src:
            assert not out.exists()
        assert leftovers(out) == []


@pytest.mark.parametrize(("case", "command"), PARAMS)
def test_bad_input_is_refused(case: Case, command: str, env: Env, cli, no_unpickling):
    setup = case.make(env)
    if setup.corrupt is not None:
        reference_rejects(setup.corrupt)  # oracle: the file really is invalid
    out = setup.out or env.tmp / "out"
    watched = _watched(setup.src)
    before_src = tree_digest(watched) if watched is not None else None
    before_out = tree_digest(out) if setup.out_preexists else None

    result = cli(*_argv(command, setup, out))

    _check_refusal(result, setup, out, watched, before_src, before_out, command)


DEBUG_CASES = ["missing-folder", "config-invalid-json", "unknown-model-type", "index-missing-shard",
               "safetensors-truncated", "out-exists-without-force"]


@pytest.mark.parametrize(
    ("case", "command"),
    [p for p in PARAMS if p.values[0].id in DEBUG_CASES and not p.marks],
)
def test_debug_env_adds_traceback_and_keeps_exit_code(case: Case, command: str, env: Env, cli, monkeypatch):
    monkeypatch.setenv("MTPKIT_DEBUG", "1")
    setup = case.make(env)
    out = setup.out or env.tmp / "out"
    watched = _watched(setup.src)
    before_src = tree_digest(watched) if watched is not None else None
    before_out = tree_digest(out) if setup.out_preexists else None

    result = cli(*_argv(command, setup, out))

    assert result.code == 2, (result.code, result.err)
    assert result.out == ""
    assert result.err.startswith("Traceback (most recent call last):"), result.err
    lines = result.err.rstrip("\n").splitlines()
    assert len(lines) > 3
    assert lines[-1].startswith(PREFIX) and sum(line.startswith(PREFIX) for line in lines) == 1
    if watched is not None:
        assert tree_digest(watched) == before_src
    if command == "reshard":
        assert (tree_digest(out) == before_out) if setup.out_preexists else not out.exists()
        assert leftovers(out) == []


@pytest.mark.parametrize("base", ["text_only", "e2b_like", "sharded"])
def test_pristine_inputs_succeed(base: str, env: Env, cli):
    """Control: every undamaged base input passes both commands, so each refusal above comes from its damage."""
    src = env.sharded() if base == "sharded" else env.tiny_copy(base)
    before = tree_digest(src)
    inspected = cli("inspect", "--json", src)
    assert inspected.code == 0, inspected.err
    assert json.loads(inspected.out)["num_tensors"] > 0
    out = env.tmp / "out"
    resharded = cli("reshard", src, out, "--max-shard-size", SHARDED_SIZE)
    assert resharded.code == 0, resharded.err
    assert out.is_dir() and leftovers(out) == []
    assert tree_digest(src) == before


@pytest.mark.parametrize("base", ["text_only", "e2b_like"])
def test_reference_accepts_pristine_file(base: str, tiny):
    """Control for the oracle: `reference_rejects` fails on a sound file, so it can tell valid from invalid."""
    path = tiny(base) / "model.safetensors"
    assert reference_reads(path)
    with pytest.raises(pytest.fail.Exception):
        reference_rejects(path)


def _limit_memory() -> None:
    # A safety net for the child below: 2 GiB of address space, far above what a tiny checkpoint needs.
    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))


@pytest.mark.parametrize("command", ["inspect", "reshard"])
def test_absurd_num_hidden_layers_is_refused_promptly(command: str, env: Env):
    """Run in a child process with a timeout: the bug this guards against is unbounded memory and time."""
    src = env.tiny_copy("text_only")

    def edit(config: dict) -> None:
        config["num_hidden_layers"] = 10**12  # a typo'd layer count; the tensors hold 3 layers
        config.pop("layer_types", None)  # so the default pattern would be built for every layer

    path = _edit_config(src, edit)
    before = tree_digest(src)
    out = env.tmp / "out"
    argv = [str(Path(sys.executable).parent / "mtp-convert"), command, str(src)]
    try:
        result = subprocess.run(argv + ([str(out)] if command == "reshard" else []), capture_output=True,
                                text=True, timeout=5, preexec_fn=_limit_memory,
                                env={k: v for k, v in os.environ.items() if k != "MTPKIT_DEBUG"})
    except subprocess.TimeoutExpired:
        result = None
    assert result is not None, f"{command} did not finish within 5 s"
    assert result.returncode == 2, result.stderr
    assert result.stdout == "" and len(result.stderr.splitlines()) == 1, result.stderr
    line = result.stderr.rstrip("\n")
    assert line.startswith(PREFIX) and names_path(line, path) and "num_hidden_layers" in line, line
    assert not out.exists() and leftovers(out) == []
    assert tree_digest(src) == before
