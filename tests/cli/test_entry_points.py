"""The installed entry points, run as real child processes: `python -m mtpkit` and the `mtp-convert` script.

In-process tests (the `cli` fixture) cannot see what only a real process shows: the console-script
wiring, exit codes as the shell sees them, stray output at import time, and OS limits on writing.
"""

from __future__ import annotations

import errno
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoConfig

from tests.conftest import EXAMPLES, tree_digest

PREFIX = "mtp-convert: error: "
SCRIPT = Path(sys.executable).parent / "mtp-convert"
ENTRY_POINTS = {
    "module": [sys.executable, "-m", "mtpkit"],
    "script": [str(SCRIPT)],
}
E4B = EXAMPLES / "gemma-4-E4B-it"


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "MTPKIT_DEBUG"}
    env["HF_HUB_OFFLINE"] = "1"  # nothing here may reach the network
    return env


def run(entry: str, *args, cwd: Path, preexec_fn=None) -> subprocess.CompletedProcess:
    return subprocess.run([*ENTRY_POINTS[entry], *map(str, args)], capture_output=True, text=True, cwd=cwd,
                          env=_env(), timeout=120, preexec_fn=preexec_fn)


def _one_error_line(stderr: str) -> str:
    assert stderr.endswith("\n") and len(stderr.splitlines()) == 1, repr(stderr)
    line = stderr.rstrip("\n")
    assert line.startswith(PREFIX) and "Traceback" not in line, line
    return line


def test_console_script_is_installed():
    assert SCRIPT.is_file() and os.access(SCRIPT, os.X_OK), SCRIPT


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_help_lists_commands(entry: str, tmp_path):
    result = run(entry, "--help", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    commands = {line.split()[0] for line in result.stdout.split("Commands:", 1)[1].splitlines() if line.strip()}
    assert {"inspect", "reshard"} <= commands, result.stdout


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_inspect_missing_folder(entry: str, tmp_path):
    missing = tmp_path / "no-such-checkpoint"
    result = run(entry, "inspect", missing, cwd=tmp_path)
    assert result.returncode == 2
    assert result.stdout == ""
    assert str(missing) in _one_error_line(result.stderr)
    assert not missing.exists()


def _kv_producers_from_transformers(folder: Path) -> dict[str, int]:
    """Oracle: the layers transformers marks 'store' in kv_sharing_modes, keyed by their attention type."""
    text = AutoConfig.from_pretrained(folder).get_text_config()
    return {text.layer_types[i]: i for i, mode in enumerate(text.kv_sharing_modes) if mode == "store"}


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_inspect_json_e4b_kv_producers(entry: str, tmp_path):
    before = tree_digest(E4B)
    result = run(entry, "inspect", "--json", E4B, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    kv = json.loads(result.stdout)["kv_producers"]
    expected = {"sliding_attention": 22, "full_attention": 23}  # published for gemma-4-E4B-it (see README)
    assert _kv_producers_from_transformers(E4B) == expected
    assert kv == expected
    assert tree_digest(E4B) == before


def _limit_file_size() -> None:
    # Runs in the child before exec. Python ignores SIGXFSZ, so a write past the limit fails with EFBIG.
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))


def test_reshard_full_disk_is_one_line_and_leaves_nothing(tiny, tmp_path):
    src = tiny("e2b_like")
    assert (src / "model.safetensors").stat().st_size > 4096  # the shard cannot fit under the limit
    before = tree_digest(src)
    out = tmp_path / "out"

    result = run("script", "reshard", src, out, cwd=tmp_path, preexec_fn=_limit_file_size)

    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    line = _one_error_line(result.stderr)
    assert str(out) in line and os.strerror(errno.EFBIG) in line, line
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir() if "mtpkit-tmp" in p.name] == []
    assert tree_digest(src) == before


def test_output_is_identical_across_processes_and_hash_seeds(tiny, tmp_path):
    """Same input, same bytes: two separate processes with different PYTHONHASHSEED write the same tree."""
    digests = []
    for seed in ("1", "2"):
        out = tmp_path / f"out-{seed}"
        env = {**_env(), "PYTHONHASHSEED": seed}
        result = subprocess.run([*ENTRY_POINTS["module"], "reshard", str(tiny("e2b_like")), str(out),
                                 "--max-shard-size", "50KB"], capture_output=True, text=True, env=env, timeout=120)
        assert result.returncode == 0, result.stderr
        digests.append(tree_digest(out))
    assert len(digests[0]) > 3 and digests[0] == digests[1]


def test_version(tmp_path):
    from importlib.metadata import version

    result = run("script", "--version", cwd=tmp_path)
    assert result.returncode == 0 and result.stdout.strip() == f"mtp-convert {version('mtpkit')}"
