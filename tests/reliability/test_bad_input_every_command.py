"""The bad-input corpus (tests/convert/bad_input_cases.py) through every command that reads a target:
`quantize`, `check`, `pair` and `run` (inspect and reshard: tests/convert/test_bad_input.py).

Each damaged target goes in with a sound assistant. The contract is the same: exit code 2, one line on
stderr naming the offending file or key, nothing on stdout, no output folder or temporary left behind, the
inputs byte-identical afterwards, and nothing unpickled.
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import tree_digest
from tests.convert.bad_input_cases import CASES, Env
from tests.convert.test_bad_input import PREFIX, _watched, leftovers, names_path, no_unpickling  # noqa: F401

INPUT_CASES = [case for case in CASES if "inspect" in case.commands]
COMMANDS = ("quantize", "check", "pair", "run")


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
    return ["run", "--target", src, "--draft", draft, "--prompt-file", prompts]


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("case", INPUT_CASES, ids=[c.id for c in INPUT_CASES])
def test_every_command_refuses_a_damaged_target(case, command, env, tiny, cli, no_unpickling, tmp_path):
    setup = case.make(env)
    draft = tiny("assistant_centroids")
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
    for name in setup.names:
        assert names_path(line, name) if not isinstance(name, str) else name in line, (line, name)
    if watched is not None:
        assert tree_digest(watched) == before
    assert tree_digest(draft) == draft_before
    assert not out.exists() and leftovers(out) == []
