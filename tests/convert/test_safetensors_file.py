"""Our header parser and per-tensor reader against the safetensors library (the reference)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from mtpkit.convert.safetensors_file import load_tensor, read_header
from mtpkit.formats.dtypes import torch_dtype

MIXED = {
    "bf16.matrix": torch.randn(33, 17).to(torch.bfloat16),
    "f32.vector": torch.randn(7),
    "f8.weight": torch.randn(16, 8).to(torch.float8_e4m3fn),
    "u8.packed": torch.randint(0, 255, (5, 3), dtype=torch.uint8),
    "i64.ordering": torch.randperm(11),
    "f16.scalar": torch.tensor(3.5, dtype=torch.float16),
    "empty": torch.empty(0, 4),
    "bool.mask": torch.rand(9) > 0.5,
}


def test_header_matches_safetensors(tmp_path):
    path = tmp_path / "m.safetensors"
    save_file(MIXED, path, metadata={"format": "pt"})
    header = read_header(path)
    assert header.metadata == {"format": "pt"}
    with safe_open(path, "pt") as f:
        assert sorted(header.tensors) == sorted(f.keys())
        for name in f.keys():
            sl = f.get_slice(name)
            info = header.tensors[name]
            assert tuple(sl.get_shape()) == info.shape
            assert sl.get_dtype() == info.dtype


def test_load_tensor_equals_safetensors(tmp_path):
    path = tmp_path / "m.safetensors"
    save_file(MIXED, path)
    reference = load_file(path)
    for name, info in read_header(path).tensors.items():
        ours = load_tensor(info)
        assert ours.dtype == reference[name].dtype and ours.shape == reference[name].shape
        assert torch.equal(ours.reshape(-1).view(torch.uint8), reference[name].reshape(-1).view(torch.uint8))


def test_writing_a_loaded_tensor_never_writes_the_file(tmp_path):
    path = tmp_path / "m.safetensors"
    save_file({"w": torch.zeros(1024)}, path)
    before = path.read_bytes()
    t = load_tensor(read_header(path).tensors["w"])
    t.add_(1.0)  # copy-on-write mapping: the tensor is writable, the file is not touched
    assert path.read_bytes() == before
    assert torch.equal(load_file(path)["w"], torch.zeros(1024))


_dtypes = st.sampled_from(["BF16", "F32", "F16", "F8_E4M3", "U8", "I32", "I64", "BOOL"])
_shapes = st.lists(st.integers(0, 5), min_size=0, max_size=3)


@settings(max_examples=40, deadline=None)
@given(st.dictionaries(st.from_regex(r"[a-z]{1,6}(\.[a-z0-9]{1,4}){0,2}", fullmatch=True),
                       st.tuples(_dtypes, _shapes), min_size=1, max_size=6))
def test_any_safetensors_file_reads_like_the_reference(tmp_path_factory, spec):
    path = tmp_path_factory.mktemp("h") / "x.safetensors"
    tensors = {}
    for name, (dtype, shape) in spec.items():
        tensors[name] = torch.randint(0, 100, shape).to(torch_dtype(dtype))
    save_file(tensors, path)
    reference = load_file(path)
    header = read_header(path)
    assert set(header.tensors) == set(reference)
    for name, info in header.tensors.items():
        got = load_tensor(info)
        assert got.shape == reference[name].shape and got.dtype == reference[name].dtype
        assert torch.equal(got.reshape(-1).view(torch.uint8), reference[name].reshape(-1).view(torch.uint8))
