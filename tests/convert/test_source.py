"""Hub sources resolved from a hand-built, pre-populated Hugging Face Hub cache (offline, no network).

The cache is laid out exactly as huggingface_hub writes it (file_download.py / _snapshot_download.py):

    <cache>/models--OWNER--NAME/blobs/<sha256 of an LFS file | git blob sha1 of a small file>
    <cache>/models--OWNER--NAME/snapshots/<40-hex commit>/<file> -> ../../blobs/<hash>   (relative symlink)
    <cache>/models--OWNER--NAME/refs/<branch>                     the commit hash, no newline

The layout is checked against huggingface_hub's own cache scanner, and every mtpkit result against an
independent oracle: safetensors' reader on the original local folder, or `inspect` on that folder.

Pointing huggingface_hub at the temporary cache: huggingface_hub.constants reads HF_HUB_CACHE and
HF_HUB_OFFLINE from the environment once, when it is first imported, and it is already imported by the
time a test runs (conftest imports transformers, which imports it). snapshot_download reads
`constants.HF_HUB_CACHE` and `constants.is_offline_mode()` (which returns `constants.HF_HUB_OFFLINE`) at
call time, so setting the environment variables alone has no effect in this process; the module
attributes must be patched too. The fixture does both (the variables for any child process).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
from pathlib import Path

import pytest
import torch
from huggingface_hub import constants as hf_constants
from huggingface_hub import scan_cache_dir
from safetensors import safe_open
from safetensors.torch import load_file

from mtpkit.convert.checkpoint import open_checkpoint
from mtpkit.convert.source import resolve_source
from mtpkit.errors import CheckpointError, SourceNotFoundError
from tests.conftest import tree_digest

REPO = "acme/tiny-e2b"
MAIN_COMMIT = "1a2b3c4d5e6f708192a3b4c5d6e7f8091a2b3c4d"
DEV_COMMIT = "fedcba98765432100123456789abcdeffedcba98"
# Looks like a token so that any code path that would print or write one is caught; it is no real token.
SENTINEL_TOKEN = "hf_SENTINELmtpkitTestTokenXq7ZzY3wV9"


# --- a hand-built Hub cache ------------------------------------------------------------------------------

def _git_blob_sha1(data: bytes) -> str:
    """What git (and so the Hub's etag for a non-LFS file) names a blob: sha1 of 'blob <len>\\0' + data."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _blob_name(rel: str, data: bytes) -> str:
    # Weights are LFS files on the Hub, whose etag (and so blob name) is the sha256 of the content.
    return hashlib.sha256(data).hexdigest() if rel.endswith(".safetensors") else _git_blob_sha1(data)


def add_commit(cache: Path, repo_id: str, commit: str, files: dict[str, bytes], *, ref: str | None) -> Path:
    """Add one commit's snapshot of `files` to the cache (and point `ref` at it); returns the snapshot folder."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    blobs = repo / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    snapshot = repo / "snapshots" / commit
    for rel, data in files.items():
        blob = blobs / _blob_name(rel, data)
        if not blob.exists():  # a blob shared by two commits is stored once
            blob.write_bytes(data)
        link = snapshot / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    if ref is not None:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)  # huggingface_hub writes the bare hash, and reads it unstripped
    return snapshot


def folder_files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# --- fixtures ---------------------------------------------------------------------------------------------

@pytest.fixture
def no_network(monkeypatch):
    """Any attempt to resolve a name or open a connection is recorded and refused; the test fails if one happened.

    Recorded, not only raised: huggingface_hub catches connection errors and falls back to the cache,
    so a refused attempt would otherwise go unnoticed.
    """
    attempts: list[str] = []

    def refuse(kind):
        def blocked(*args, **kwargs):
            attempts.append(f"{kind}{args[1:] if kind != 'getaddrinfo' else args[:2]}")
            raise OSError(f"network access blocked by the test ({kind})")
        return blocked

    monkeypatch.setattr(socket.socket, "connect", refuse("connect"))
    monkeypatch.setattr(socket.socket, "connect_ex", refuse("connect_ex"))
    monkeypatch.setattr(socket, "getaddrinfo", refuse("getaddrinfo"))
    # The guard itself works (or every "no network" claim below would be empty).
    with pytest.raises(OSError, match="blocked by the test"):
        socket.create_connection(("127.0.0.1", 9), timeout=1)
    attempts.clear()
    yield attempts
    assert attempts == [], f"the test reached for the network: {attempts}"


def use_offline_cache(monkeypatch, cache, workdir) -> None:
    """Point huggingface_hub at `cache`, offline, and run from `workdir` (so "acme/..." is never a local folder)."""
    for name, value in (("HF_HUB_CACHE", str(cache)), ("HF_HUB_OFFLINE", "1")):
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.delenv("HF_HOME", raising=False)
    monkeypatch.chdir(workdir)


@pytest.fixture
def hub_cache(tmp_path, monkeypatch, tiny, no_network):
    """An offline Hub cache holding acme/tiny-e2b: main = a copy of tiny("e2b_like"), dev = tiny("text_only")."""
    cache = tmp_path / "hub-cache"
    cache.mkdir()
    main = add_commit(cache, REPO, MAIN_COMMIT, folder_files(tiny("e2b_like")), ref="main")
    dev = add_commit(cache, REPO, DEV_COMMIT, folder_files(tiny("text_only")), ref="dev")
    use_offline_cache(monkeypatch, cache, tmp_path)
    return {"cache": cache, "main": main, "dev": dev}


# --- the cache itself ---------------------------------------------------------------------------------------

def test_hand_built_cache_is_what_huggingface_hub_sees(hub_cache):
    info = scan_cache_dir(hub_cache["cache"])
    assert info.warnings == []
    (repo,) = info.repos
    assert (repo.repo_id, repo.repo_type) == (REPO, "model")
    refs = {rev.commit_hash: set(rev.refs) for rev in repo.revisions}
    assert refs == {MAIN_COMMIT: {"main"}, DEV_COMMIT: {"dev"}}
    link = hub_cache["main"] / "model.safetensors"
    assert link.is_symlink() and not os.path.isabs(os.readlink(link))
    assert link.resolve().parent == hub_cache["cache"] / "models--acme--tiny-e2b" / "blobs"


# --- resolve_source / open_checkpoint -------------------------------------------------------------------------

def test_resolve_source_gives_the_snapshot_folder(hub_cache):
    source = resolve_source(REPO)
    assert source.folder == hub_cache["main"]
    assert source.repo_id == REPO and source.revision is None
    assert source.allowed_root.resolve() == (hub_cache["cache"] / "models--acme--tiny-e2b").resolve()


def test_resolve_source_revision_picks_the_branch_commit(hub_cache):
    source = resolve_source(REPO, revision="dev")
    assert source.folder == hub_cache["dev"]
    assert source.revision == "dev"
    # A full commit hash is looked up directly under snapshots/, with no ref.
    assert resolve_source(REPO, revision=DEV_COMMIT).folder == hub_cache["dev"]


def test_resolve_source_config_only_uses_the_same_snapshot(hub_cache):
    assert resolve_source(REPO, weights=False).folder == hub_cache["main"]


def test_unknown_revision_offline_is_a_clear_error(hub_cache):
    with pytest.raises(SourceNotFoundError, match="not in the Hub cache"):
        resolve_source(REPO, revision="no-such-branch")


def test_open_checkpoint_from_cache_matches_the_local_folder(hub_cache, tiny):
    local = tiny("e2b_like")
    source = resolve_source(REPO)
    checkpoint = open_checkpoint(source.folder, allowed_root=source.allowed_root)
    with safe_open(local / "model.safetensors", "pt") as f:
        expected = {name: (f.get_slice(name).get_dtype(), tuple(f.get_slice(name).get_shape())) for name in f.keys()}
    assert {name: (t.dtype, t.shape) for name, t in checkpoint.tensors.items()} == expected
    oracle = load_file(local / "model.safetensors")
    seen = 0
    for name, tensor in checkpoint.iter_tensors():
        assert tensor.dtype == oracle[name].dtype and torch.equal(tensor, oracle[name]), name
        seen += 1
    assert seen == len(oracle) > 0
    assert checkpoint.config == json.loads((local / "config.json").read_text())


def test_open_checkpoint_refuses_cache_links_without_allowed_root(hub_cache):
    # The snapshot's links point into ../../blobs: outside the snapshot folder itself.
    source = resolve_source(REPO)
    with pytest.raises(CheckpointError, match="outside"):
        open_checkpoint(source.folder)


# --- the CLI ----------------------------------------------------------------------------------------------------

def _json(result) -> dict:
    assert result.code == 0, result.err
    return json.loads(result.out)


def test_inspect_with_weights_matches_the_local_folder(hub_cache, tiny, cli):
    from_hub = _json(cli("inspect", REPO, "--weights", "--json"))
    local = _json(cli("inspect", tiny("e2b_like"), "--json"))
    assert from_hub.pop("path") == REPO
    local.pop("path")
    assert from_hub == local
    assert from_hub["config_only"] is False and from_hub["num_tensors"] > 0


def test_inspect_without_weights_is_config_only(hub_cache, tiny, cli):
    from_hub = _json(cli("inspect", REPO, "--json"))
    local = _json(cli("inspect", tiny("e2b_like"), "--json"))
    assert from_hub["config_only"] is True
    assert from_hub["num_tensors"] == 0 and from_hub["shards"] == 0 and from_hub["num_parameters"] is None
    assert from_hub["kv_producers"] == local["kv_producers"] and local["kv_producers"]
    for key in ("role", "model_type", "architectures", "architecture", "layer_types", "quantization"):
        assert from_hub[key] == local[key], key


def test_inspect_revision_picks_the_branch_commit(hub_cache, tiny, cli):
    dev = _json(cli("inspect", REPO, "--revision", "dev", "--weights", "--json"))
    local_dev = _json(cli("inspect", tiny("text_only"), "--json"))
    local_main = _json(cli("inspect", tiny("e2b_like"), "--json"))
    for d in (dev, local_dev, local_main):
        d.pop("path")
    assert dev == local_dev
    assert dev != local_main  # the two commits really differ


def test_uncached_repo_offline_exits_2_with_one_line(hub_cache, cli):
    result = cli("inspect", "acme/not-cached", "--json")
    assert result.code == 2
    assert result.out == ""
    lines = result.err.strip().splitlines()
    assert len(lines) == 1, result.err
    assert "acme/not-cached" in lines[0]
    assert "not in the Hub cache" in lines[0] and "HF_HUB_OFFLINE" in lines[0]


def test_reshard_from_the_cache(hub_cache, tiny, cli, tmp_path):
    local = tiny("e2b_like")
    out = tmp_path / "out"
    # A small shard size so the output really is re-sharded (several shards and an index).
    result = cli("reshard", REPO, out, "--max-shard-size", "100KB", "--json")
    assert result.code == 0, result.err
    summary = json.loads(result.out)
    assert summary["shards"] > 1
    shards = sorted(out.glob("*.safetensors"))
    assert len(shards) == summary["shards"]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {p.name for p in shards}

    oracle = load_file(local / "model.safetensors")
    written: dict[str, torch.Tensor] = {}
    for shard in shards:
        part = load_file(shard)
        assert not set(part) & set(written)
        written.update(part)
    assert written.keys() == oracle.keys()
    for name, tensor in oracle.items():
        assert written[name].dtype == tensor.dtype and torch.equal(written[name], tensor), name

    # Other files arrive as plain files (not links into the cache) with the original bytes.
    for name in ("config.json", "generation_config.json"):
        assert not (out / name).is_symlink()
        assert (out / name).read_bytes() == (local / name).read_bytes()
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [*(p.name for p in shards), "model.safetensors.index.json", "config.json", "generation_config.json"])


def test_reshard_from_the_cache_default_size_is_byte_identical_data(hub_cache, tiny, cli, tmp_path):
    # One shard: the tensors' bytes equal the original's (order may differ; compare per tensor).
    out = tmp_path / "one"
    result = cli("reshard", REPO, out)
    assert result.code == 0, result.err
    oracle = load_file(tiny("e2b_like") / "model.safetensors")
    written = load_file(out / "model.safetensors")
    assert written.keys() == oracle.keys()
    assert all(torch.equal(written[k], oracle[k]) for k in oracle)


def test_token_is_never_printed_or_written(hub_cache, cli, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", SENTINEL_TOKEN)
    cache_before = tree_digest(hub_cache["cache"])
    outputs = [
        cli("inspect", REPO, "--json"),
        cli("inspect", REPO, "--weights"),
        cli("inspect", REPO, "--revision", "dev", "--weights", "--json"),
        cli("reshard", REPO, tmp_path / "out", "--max-shard-size", "100KB"),
        cli("reshard", REPO, tmp_path / "out-json", "--json"),
        cli("inspect", "acme/not-cached"),  # the error path too
    ]
    assert [r.code for r in outputs] == [0, 0, 0, 0, 0, 2]
    for result in outputs:
        assert SENTINEL_TOKEN not in result.out and SENTINEL_TOKEN not in result.err
    needle = SENTINEL_TOKEN.encode()
    for folder in (tmp_path / "out", tmp_path / "out-json", hub_cache["cache"]):
        files = [p for p in folder.rglob("*") if p.is_file()]
        assert files
        for path in files:
            assert needle not in path.read_bytes(), path
    assert tree_digest(hub_cache["cache"]) == cache_before  # the cache was only read


def test_source_folder_is_untouched_by_reshard(hub_cache, cli, tmp_path):
    before = tree_digest(hub_cache["main"])
    links = {p.name: os.readlink(p) for p in hub_cache["main"].iterdir()}
    assert cli("reshard", REPO, tmp_path / "out").code == 0
    assert tree_digest(hub_cache["main"]) == before
    assert {p.name: os.readlink(p) for p in hub_cache["main"].iterdir()} == links


def test_copy_of_the_local_folder_is_not_mistaken_for_a_repo(hub_cache, tiny, tmp_path, cli):
    # A local folder whose relative path looks like OWNER/NAME is used as a folder, not looked up.
    local = tmp_path / "acme" / "tiny-e2b"
    shutil.copytree(tiny("text_only"), local)
    source = resolve_source(REPO)
    assert source.repo_id is None and source.folder == Path(REPO)
    assert _json(cli("inspect", REPO, "--json"))["config_only"] is False


def test_inspect_weights_on_a_config_only_cached_snapshot_says_so(tmp_path, monkeypatch, tiny, cli, no_network):
    cache = tmp_path / "partial-cache"
    add_commit(cache, REPO, MAIN_COMMIT, {"config.json": (tiny("e2b_like") / "config.json").read_bytes()}, ref="main")
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)
    for args in (("inspect", REPO, "--weights", "--json"), ("reshard", REPO, tmp_path / "out")):
        result = cli(*args)
        assert result.code == 2 and result.out == ""
        assert result.err.strip() == (f"mtp-convert: error: {REPO}: the cached snapshot holds no safetensors weights; "
                                      "run again with network access (HF_HUB_OFFLINE unset) to download them")
    assert not (tmp_path / "out").exists()
