"""The streaming sharded writer, checked with the safetensors library and the index rules transformers reads."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load_file

from mtpkit.convert.safetensors_file import read_header
from mtpkit.convert.writer import TensorSpec, parse_shard_size, write_checkpoint_tensors
from mtpkit.errors import OutputError
from mtpkit.formats.dtypes import safetensors_dtype


def _specs(tensors: dict[str, torch.Tensor]) -> list[TensorSpec]:
    return [TensorSpec(n, safetensors_dtype(t.dtype), tuple(t.shape)) for n, t in tensors.items()]


def _write(folder, tensors, max_shard_size):
    return write_checkpoint_tensors(folder, _specs(tensors), lambda spec: tensors[spec.name],
                                    max_shard_size=max_shard_size)


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(64, 32, generator=g).to(torch.bfloat16),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(32, 32, generator=g).to(torch.float8_e4m3fn),
        "model.layers.0.self_attn.q_proj.weight_scale": torch.rand(32, 1, generator=g),
        "model.layers.0.mlp.down_proj.weight_packed": torch.randint(0, 255, (17, 9), dtype=torch.uint8, generator=g),
        "model.layers.0.layer_scalar": torch.ones(1, dtype=torch.bfloat16),
        "lm_head.token_ordering": torch.randperm(64, generator=g),
    }


def test_sharded_output_reads_back_with_safetensors_and_a_correct_index(tmp_path):
    tensors = _tensors()
    weight_map = _write(tmp_path, tensors, max_shard_size=3000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    assert index["weight_map"] == weight_map and set(weight_map) == set(tensors)
    shards = sorted(set(weight_map.values()))
    assert len(shards) > 1 and all(s.endswith(f"-of-{len(shards):05d}.safetensors") for s in shards)
    for shard in shards:
        loaded = load_file(tmp_path / shard)
        assert {n for n, s in weight_map.items() if s == shard} == set(loaded)
        for name, value in loaded.items():
            assert value.dtype == tensors[name].dtype
            assert torch.equal(value.view(torch.uint8), tensors[name].view(torch.uint8))
        with safe_open(tmp_path / shard, "pt") as f:
            assert f.metadata() == {"format": "pt"}


def test_one_shard_is_model_safetensors_without_index(tmp_path):
    _write(tmp_path, _tensors(), max_shard_size="5GB")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]


def test_same_input_gives_identical_bytes(tmp_path):
    for run in ("a", "b"):
        (tmp_path / run).mkdir()
        _write(tmp_path / run, _tensors(), max_shard_size=2000)
    files = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "b").iterdir())
    for name in files:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_every_tensor_is_aligned_to_its_element_size(tmp_path):
    _write(tmp_path, _tensors(), max_shard_size="5GB")
    for name, value in load_file(tmp_path / "model.safetensors").items():
        assert read_header(tmp_path / "model.safetensors").tensors[name].start % value.element_size() == 0


def test_a_produced_tensor_of_the_wrong_shape_is_refused(tmp_path):
    tensors = _tensors()
    specs = _specs(tensors)
    with pytest.raises(OutputError, match="planned"):
        write_checkpoint_tensors(tmp_path, specs, lambda spec: tensors[spec.name].reshape(-1))


@pytest.mark.parametrize(("text", "expected"), [("5GB", 5 * 10**9), ("500MB", 5 * 10**8), ("2GiB", 2 * 2**30),
                                                ("1.5GB", 15 * 10**8), ("2000000", 2_000_000), (4096, 4096)])
def test_shard_sizes_parse_like_transformers(text, expected):
    assert parse_shard_size(text) == expected


@pytest.mark.parametrize("text", ["lots", "-1GB", "0", "5 parsecs", ""])
def test_bad_shard_sizes_are_refused(text):
    with pytest.raises(OutputError, match="max shard size"):
        parse_shard_size(text)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(1, 400), min_size=1, max_size=12), st.integers(64, 1500))
def test_shards_respect_the_limit_unless_one_tensor_exceeds_it(tmp_path_factory, sizes, limit):
    folder = tmp_path_factory.mktemp("w")
    tensors = {f"t{i:02d}": torch.zeros(n, dtype=torch.bfloat16) for i, n in enumerate(sizes)}
    weight_map = _write(folder, tensors, max_shard_size=limit)
    for shard in set(weight_map.values()):
        loaded = load_file(folder / shard)
        data = sum(t.numel() * t.element_size() for t in loaded.values())
        assert data <= limit or len(loaded) == 1
    assert set(weight_map) == set(tensors)
