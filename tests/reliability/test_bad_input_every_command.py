"""The bad-input corpus (tests/convert/bad_input_cases.py) through every command that reads a target:
`quantize`, `check`, `pair`, `run` and `push --dry-run` (inspect and reshard: tests/convert/test_bad_input.py;
draft has its own corpus of damaged assistants: tests/convert/test_draft_corpus.py).

Each damaged target goes in with a sound assistant. The contract is the same: exit code 2, one line on
stderr naming the offending file or key, nothing on stdout, no output folder or temporary left behind, the
inputs byte-identical afterwards, and nothing unpickled.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import tree_digest
from tests.convert.bad_input_cases import CASES, Env
from tests.convert.test_bad_input import PREFIX, _watched, leftovers, names_path, no_unpickling  # noqa: F401

INPUT_CASES = [case for case in CASES if "inspect" in case.commands]
COMMANDS = ("quantize", "check", "pair", "run", "push")


@pytest.fixture
def env(tmp_path, tiny_copy, monkeypatch):
    monkeypatch.delenv("MTPKIT_DEBUG", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return Env(tmp_path, tiny_copy)


def _argv(command: str, src, draft, out, prompts) -> list:
    if command == "quantize":
        return ["quantize", src, out, "--scheme", "nvfp4a16", "--no-evaluate"]
    if command == "check":
        return ["check", "--target", src, "--draft", draft]
    if command == "pair":
        return ["pair", out, "--target", src, "--draft", draft]
    if command == "push":
        return ["push", src, "--repo-id", "someone/tiny", "--dry-run"]
    return ["run", "--target", src, "--draft", draft, "--prompt-file", prompts]


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("case", INPUT_CASES, ids=[c.id for c in INPUT_CASES])
def test_every_command_refuses_a_damaged_target(case, command, env, tiny, cli, no_unpickling, tmp_path):
    setup = case.make(env)
    draft = tiny("assistant_centroids")
    names = list(setup.names)
    if command == "push":  # push takes a pair folder: a sound pair whose target/ is the damaged copy
        if not setup.src.is_dir():
            pytest.skip("push takes a pair folder; the case damages what is not one")
        pair = tmp_path / "pushed"
        assert cli("pair", pair, "--target", tiny("e2b_like"), "--draft", draft).code == 0
        shutil.rmtree(pair / "target")
        shutil.copytree(setup.src, pair / "target", symlinks=True)
        names = [Path(str(n).replace(str(setup.src), str(pair / "target"))) if isinstance(n, Path) else n
                 for n in names]
        setup = dataclasses.replace(setup, src=pair)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"input_ids": [5, 6, 7]}) + "\n")
    out = tmp_path / "out"
    watched = _watched(setup.src)
    before = tree_digest(watched) if watched is not None else None
    draft_before = tree_digest(draft)

    result = cli(*_argv(command, setup.src, draft, out, prompts))

    assert result.code == 2, (result.code, result.err)
    assert result.out == "" and "Traceback" not in result.err
    assert len(result.err.splitlines()) == 1, result.err
    line = result.err.rstrip("\n")
    assert line.startswith(PREFIX), line
    for name in names:  # a folder counts as named when the line names a file inside it (more precise)
        found = name in line if isinstance(name, str) else names_path(line, name) or f"{name}/" in line
        assert found, (line, name)
    if watched is not None:
        assert tree_digest(watched) == before
    assert tree_digest(draft) == draft_before
    assert not out.exists() and leftovers(out) == []
