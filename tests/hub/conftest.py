"""Fixtures for `push`: tiny pair folders (built once), and a fake Hub on 127.0.0.1 that huggingface_hub talks to."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest
import torch
import yaml

from mtpkit.cli import push_cmd
from mtpkit.cli.app import main
from tests.hub.fake_hub import FakeHub

PUSH = push_cmd.push_command  # importing the module registers `push` on the app (as app._register does)
TOKEN = "hf_SentinelTokenNeverPrintMe0123456789abc"  # the shape of a real token, so every scan applies


def run_main(*args) -> None:
    """`mtp-convert ARGS` for session fixtures (no capsys there); fails on a non-zero exit."""
    try:
        main([str(a) for a in args])
    except SystemExit as e:
        assert e.code in (0, None), (args, e.code)


@pytest.fixture(scope="session")
def hub_root(tmp_path_factory):
    return tmp_path_factory.mktemp("hub-pairs")


@pytest.fixture(scope="session")
def pair_dir(tiny, hub_root):
    """A BF16 pair (e2b-like target, centroid assistant): target/model.safetensors is one LFS file."""
    out = hub_root / "pair"
    run_main("pair", out, "--target", tiny("e2b_like"), "--draft", tiny("assistant_centroids"))
    return out


@pytest.fixture(scope="session")
def quantized_pair_dir(tiny, hub_root):
    """`pair --quantize nvfp4a16` with evaluation numbers (token-id calibration text, no tokenizer needed)."""
    g = torch.Generator().manual_seed(7)
    calib = hub_root / "calib.jsonl"
    calib.write_text("".join(json.dumps({"input_ids": torch.randint(3, 120, (9,), generator=g).tolist()}) + "\n"
                             for _ in range(3)))
    out = hub_root / "pair-nvfp4"
    run_main("pair", out, "--target", tiny("e2b_like"), "--draft", tiny("assistant_centroids"),
             "--quantize", "nvfp4a16", "--calib", calib)
    return out


@pytest.fixture(scope="session")
def sharded_pair_dir(tiny, hub_root):
    """A pair whose target is in several shards (several LFS files to resume between)."""
    sharded = hub_root / "e2b-sharded"
    run_main("reshard", tiny("e2b_like"), sharded, "--max-shard-size", "100KB")
    out = hub_root / "pair-sharded"
    run_main("pair", out, "--target", sharded, "--draft", tiny("assistant_centroids"))
    assert len(list((out / "target").glob("*.safetensors"))) >= 3
    return out


@pytest.fixture
def pair_copy(tmp_path):
    """pair_copy(folder) -> a private copy of a pair folder that a test may change."""

    def copy(folder):
        dest = tmp_path / folder.name
        shutil.copytree(folder, dest)
        return dest

    return copy


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """A fake Hub, with huggingface_hub pointed at it: HF_ENDPOINT, the sentinel HF_TOKEN, LFS (no Xet), no waits."""
    from huggingface_hub import constants

    import mtpkit.hub.upload as upload

    with FakeHub(token=TOKEN) as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        monkeypatch.setattr(constants, "ENDPOINT", server.url)
        monkeypatch.setenv("HF_TOKEN", TOKEN)
        home = tmp_path / "hf-home"
        monkeypatch.setenv("HF_HOME", str(home))  # no stored login of this machine is read
        monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(home / "token"))
        monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)  # the fake speaks LFS; hf_xet needs a CAS server
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.delenv("MTPKIT_DEBUG", raising=False)
        server.sleeps = []
        monkeypatch.setattr(upload, "sleep", server.sleeps.append)  # our backoff, recorded
        monkeypatch.setattr("huggingface_hub.utils._http.time.sleep", lambda seconds: None)  # the library's
        yield server


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def front_matter(card: str) -> dict:
    assert card.startswith("---\n"), card[:80]
    return yaml.safe_load(card[4:card.index("\n---\n", 4)])
