"""Crash safety and determinism of the writing commands (draft, quantize, pair), in real processes.

SIGKILL at several points of a run: afterwards OUT is either absent or complete (never partial), and a re-run
succeeds and cleans up what the killed one left. A full disk (RLIMIT_FSIZE): one clear line, exit 2, nothing
left. Two processes with different PYTHONHASHSEED write byte-identical trees.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time

import pytest

from tests.cli.test_entry_points import ENTRY_POINTS, _env, _limit_file_size, _one_error_line
from tests.conftest import tree_digest


def _argv(command: str, tiny, out, calib) -> list[str]:
    if command == "draft":
        return ["draft", str(tiny("assistant_centroids")), str(out)]
    if command == "quantize":
        return ["quantize", str(tiny("e2b_like")), str(out), "--scheme", "nvfp4", "--kv-cache", "fp8", "--calib",
                str(calib)]
    return ["pair", str(out), "--target", str(tiny("e2b_like")), "--draft", str(tiny("assistant_centroids"))]


@pytest.fixture
def calib(tmp_path):
    path = tmp_path / "calib.jsonl"
    path.write_text(json.dumps({"input_ids": list(range(3, 30))}) + "\n")
    return path


def _complete(command: str, out) -> bool:
    """What a finished run leaves: the command's own marker files."""
    marker = {"draft": "mtpkit_draft.json", "quantize": "mtpkit_quantize.json", "pair": "pair.json"}[command]
    return (out / marker).is_file() and (out / "config.json" if command != "pair" else out / "target").exists()


@pytest.mark.parametrize("command", ["draft", "quantize", "pair"])
def test_sigkill_leaves_nothing_partial_and_a_rerun_succeeds(command, tiny, tmp_path, calib):
    rng = random.Random(command)
    for attempt in range(2):
        out = tmp_path / f"out-{attempt}"
        process = subprocess.Popen([*ENTRY_POINTS["module"], *_argv(command, tiny, out, calib)], env=_env(),
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(0.5, 4.0))  # start-up (imports) takes about a second; the write follows
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=60)
        assert not out.exists() or _complete(command, out), f"partial output after SIGKILL: {sorted(out.iterdir())}"
        rerun = subprocess.run([*ENTRY_POINTS["module"], *_argv(command, tiny, out, calib), "--force"],
                               capture_output=True, text=True, env=_env(), timeout=120)
        assert rerun.returncode == 0, rerun.stderr
        assert _complete(command, out)
        assert [p.name for p in tmp_path.iterdir() if "mtpkit-tmp" in p.name] == []  # the killed run's temporary


@pytest.mark.parametrize("command", ["draft", "quantize", "pair"])
def test_full_disk_is_one_line_and_leaves_nothing(command, tiny, tmp_path, calib):
    out = tmp_path / "out"
    result = subprocess.run([*ENTRY_POINTS["module"], *_argv(command, tiny, out, calib)], capture_output=True,
                            text=True, env=_env(), timeout=120, preexec_fn=_limit_file_size)
    assert result.returncode == 2, result.stderr
    line = _one_error_line(result.stderr)
    assert os.strerror(27) in line or "File too large" in line, line  # EFBIG
    assert not out.exists() and [p.name for p in tmp_path.iterdir() if "mtpkit-tmp" in p.name] == []


@pytest.mark.parametrize("command", ["draft", "quantize", "pair"])
def test_same_bytes_across_processes_and_hash_seeds(command, tiny, tmp_path, calib):
    digests = []
    for seed in ("1", "2"):
        out = tmp_path / f"out-{seed}"
        result = subprocess.run([*ENTRY_POINTS["module"], *_argv(command, tiny, out, calib)], capture_output=True,
                                text=True, env={**_env(), "PYTHONHASHSEED": seed}, timeout=120)
        assert result.returncode == 0, result.stderr
        digest = tree_digest(out)
        if command == "pair":  # pair.json names its own output folder in the launch lines
            digest.pop("pair.json")
            texts = [(tmp_path / f"out-{s}" / "pair.json").read_text().replace(str((tmp_path / f"out-{s}").resolve()),
                                                                             "OUT") for s in ("1", seed)]
            assert texts[0] == texts[1]
        digests.append(digest)
    assert len(digests[0]) >= 3 and digests[0] == digests[1]
