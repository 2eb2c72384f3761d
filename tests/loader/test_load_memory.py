"""What loading costs in memory: no second copy of a BF16 target, and model_bytes equal to what the model holds.

Peak RSS: a ~1 GiB BF16 target is loaded in a fresh interpreter (so this process's memory does not count) and
every weight is read afterwards (so memory-mapped pages are resident and counted, as they would be after the
first forward). Its peak RSS (getrusage's ru_maxrss) must grow by less than 1.3x the checkpoint: a loader that
read the file into memory and then cast or moved it would hold two copies at its peak (2x).

The checkpoint is written by hand, cheaply: transformers' Gemma4ForCausalLM built on the meta device gives the
tensor names and shapes (tied lm_head left out, as save_pretrained does), and a safetensors file of that layout
is written as a header followed by a hole (a sparse file of zeros: nothing to generate or write). safetensors'
own reader checks the file. Most of the bytes are the embedding table (vocab 2^19 x hidden 1024).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import Gemma4ForCausalLM

from mtpkit.cli.app import main
from mtpkit.convert.checkpoint import open_checkpoint
from mtpkit.loader import load_draft, load_target
from mtpkit.loader.memory import model_bytes
from tests.fixtures.gemma4_tiny import _text_config

ROOT = Path(__file__).resolve().parents[2]
CHILD = """
import json, resource, sys
import torch
torch.set_num_threads(1)
from mtpkit.loader import load_target

def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))

before = rss()
loaded = load_target(sys.argv[1], device="cpu", dtype="bfloat16")
held = 0
for tensor in list(loaded.model.parameters()) + list(loaded.model.buffers()):
    held += tensor.numel() * tensor.element_size()
    if tensor.numel():
        torch.amax(tensor.float() if tensor.numel() < 2**20 else tensor)  # read every page, copying nothing big
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
print(json.dumps({"before": before, "peak": peak, "after": rss(), "held": held, "nbytes": loaded.nbytes,
                  "dtype": str(loaded.model.embed_tokens.weight.dtype)}))
"""


def _write_sparse_safetensors(path: Path, shapes: dict[str, tuple[int, ...]]) -> int:
    """A valid safetensors file of BF16 zeros, written as a header and a hole; returns the data size."""
    header, offset = {}, 0
    for name, shape in sorted(shapes.items()):
        size = 2 * math.prod(shape)
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)
    return offset


@pytest.fixture(scope="module")
def big_target(tmp_path_factory):
    folder = tmp_path_factory.mktemp("big") / "target"
    folder.mkdir()
    config = _text_config(vocab_size=2**19, hidden_size=1024, intermediate_size=64, num_hidden_layers=2,
                          layer_types=["sliding_attention", "full_attention"], num_attention_heads=2,
                          num_key_value_heads=1, head_dim=64, global_head_dim=64)
    config.save_pretrained(folder)
    with torch.device("meta"):
        model = Gemma4ForCausalLM(config)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items() if name != "lm_head.weight"}
    assert config.tie_word_embeddings
    size = _write_sparse_safetensors(folder / "model.safetensors", shapes)
    with safe_open(folder / "model.safetensors", "pt") as f:  # safetensors' reader accepts it
        assert {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()} == shapes
    assert 2**30 <= size < 1.1 * 2**30
    return folder, size


def test_peak_rss_of_loading_a_bf16_target_is_one_copy(big_target):
    folder, size = big_target
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    run = subprocess.run([sys.executable, "-c", CHILD, str(folder)], capture_output=True, text=True, env=env,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    print(f"\ncheckpoint {size / 2**30:.3f} GiB; RSS before loading {result['before'] / 2**30:.3f} GiB, "
          f"peak {result['peak'] / 2**30:.3f} GiB, growth {(result['peak'] - result['before']) / size:.3f}x")
    assert result["dtype"] == "torch.bfloat16"
    # The model holds the checkpoint's bytes (plus a few computed buffers), and model_bytes says so.
    assert result["nbytes"] == size and size <= result["held"] < size + 4096
    # Every weight was read, so one copy is resident ...
    assert result["after"] - result["before"] > 0.9 * size
    # ... and never two.
    assert result["peak"] - result["before"] < 1.3 * size


@pytest.fixture(scope="module")
def quantized(tiny, tmp_path_factory):
    """Quantized targets whose estimate has special cases: per-expert MoE tensors (held as fused dense experts,
    scales dropped) and float32 weight scales (kept as stored, not cast to the compute dtype)."""
    root = tmp_path_factory.mktemp("q")
    built = {}

    def get(name: str, scheme: str) -> Path:
        if (name, scheme) not in built:
            out = root / f"{name}-{scheme}"
            try:
                main(["quantize", str(tiny(name)), str(out), "--scheme", scheme, "--no-evaluate"])
            except SystemExit as e:
                assert e.code in (0, None)
            built[name, scheme] = out
        return built[name, scheme]

    return get


def _held(module: torch.nn.Module) -> int:
    """Bytes of every parameter and buffer, each storage counted once (tied tensors share one)."""
    seen = {}
    for t in itertools.chain(module.parameters(), module.buffers()):
        seen[t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape)] = t.numel() * t.element_size()
    return sum(seen.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("source", ["e2b_like", "moe_26b_like", "multimodal", "assistant_centroids",
                                    "assistant_plain", "moe_26b_like:nvfp4a16", "moe_26b_like:fp8-dynamic",
                                    "e2b_like:nvfp4a16"])
def test_model_bytes_is_what_the_loaded_model_holds(tiny, quantized, source, dtype):
    name, _, scheme = source.partition(":")
    folder = quantized(name, scheme) if scheme else tiny(name)
    load = load_draft if name.startswith("assistant") else load_target
    loaded = load(folder, device="cpu", dtype=dtype)
    estimate = model_bytes(open_checkpoint(folder), dtype)
    held = _held(loaded.model)
    assert loaded.nbytes == estimate
    # What the model holds beyond the estimate: only the buffers computed at build time (RoPE frequencies,
    # embedding scales), a few dozen bytes whatever the checkpoint.
    assert estimate <= held <= estimate + 256, (estimate, held)
    floats = [t for t in loaded.model.parameters() if t.is_floating_point() and t.element_size() > 1]
    assert floats and all(t.dtype == dtype for t in floats)
