"""Re-sharding round trips: transformers loads the result, tensors and side files are unchanged, runs repeat."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from mtpkit.convert.checkpoint import open_checkpoint
from mtpkit.convert.reshard import reshard
from mtpkit.errors import OutputError
from tests.conftest import tree_digest


def _all_tensors(folder):
    out = {}
    for shard in sorted(folder.glob("*.safetensors")):
        out.update(load_file(shard))
    return out


def _with_side_files(folder):
    (folder / "tokenizer_config.json").write_text('{"model_max_length": 256}\n')
    (folder / "chat_template.jinja").write_text("{{ messages }}\n")
    (folder / "pytorch_model.bin").write_bytes(b"PK\x03\x04 a pickle must never be passed on")
    return folder


def test_reshard_round_trip_loads_in_transformers(tiny, tiny_copy, tmp_path):
    src = _with_side_files(tiny_copy("e2b_like"))
    before = tree_digest(src)
    out = tmp_path / "sharded"
    result = reshard(open_checkpoint(src), out, max_shard_size="20KB")
    assert result.shards > 1 and tree_digest(src) == before

    original, resharded = _all_tensors(src), _all_tensors(out)
    assert original.keys() == resharded.keys()
    assert all(torch.equal(original[k], resharded[k]) for k in original)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in original.values())
    for name, shard in index["weight_map"].items():
        assert name in load_file(out / shard)

    # Side files byte for byte; never the pickle.
    assert tree_digest(out)["chat_template.jinja"] == before["chat_template.jinja"]
    assert tree_digest(out)["config.json"] == before["config.json"]
    assert not (out / "pytorch_model.bin").exists()

    # transformers itself (the reference loader) reads the sharded output into the same model.
    a = AutoModelForCausalLM.from_pretrained(tiny("e2b_like")).state_dict()
    b = AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_reshard_twice_gives_identical_bytes_and_back_to_one_shard(tiny, tmp_path):
    src = tiny("moe_26b_like")
    reshard(open_checkpoint(src), tmp_path / "a", max_shard_size="10KB")
    reshard(open_checkpoint(src), tmp_path / "b", max_shard_size="10KB")
    assert tree_digest(tmp_path / "a") == tree_digest(tmp_path / "b")
    reshard(open_checkpoint(tmp_path / "a"), tmp_path / "one", max_shard_size="5GB")
    assert not (tmp_path / "one" / "model.safetensors.index.json").exists()
    original, merged = load_file(src / "model.safetensors"), load_file(tmp_path / "one" / "model.safetensors")
    assert original.keys() == merged.keys() and all(torch.equal(original[k], merged[k]) for k in original)


def test_existing_output_needs_force_and_force_replaces_it(tiny, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    with pytest.raises(OutputError, match="--force"):
        reshard(open_checkpoint(tiny("text_only")), out)
    assert (out / "stale.txt").read_text() == "old"
    reshard(open_checkpoint(tiny("text_only")), out, force=True)
    assert not (out / "stale.txt").exists() and (out / "model.safetensors").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temporaries left beside it


@pytest.mark.parametrize("where", ["same", "inside"])
def test_output_overlapping_the_input_is_refused_even_with_force(tiny_copy, where):
    src = tiny_copy("text_only")
    before = tree_digest(src)
    out = src if where == "same" else src / "nested"
    with pytest.raises(OutputError, match="overlaps the input"):
        reshard(open_checkpoint(src), out, force=True)
    assert tree_digest(src) == before


def test_a_failure_mid_write_leaves_no_output(tiny, tmp_path, monkeypatch):
    import mtpkit.convert.writer as writer

    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return real(*args, **kwargs)

    real = writer.copy_tensor_bytes
    monkeypatch.setattr(writer, "copy_tensor_bytes", failing)
    with pytest.raises(OutputError, match="No space left"):
        reshard(open_checkpoint(tiny("e2b_like")), tmp_path / "out", max_shard_size="20KB")
    assert list(tmp_path.iterdir()) == []
