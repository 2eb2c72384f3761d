"""load_pair refuses bad input with the typed exception, before loading anything, and modifies nothing.

Every case damages a private copy of a tiny fixture, records tree_digest of every folder involved, and checks
the bytes are unchanged after the refusal.
"""

from __future__ import annotations

import json

import pytest
import torch

from mtpkit.convert.checkpoint import open_checkpoint
from mtpkit.errors import (CheckpointError, ConfigError, InsufficientMemoryError, MtpkitError, PairCheckError,
                           UnsupportedModelError)
from mtpkit.loader import load_draft, load_pair
from mtpkit.loader.memory import MARGIN, model_bytes
from tests.conftest import tree_digest
from tests.fixtures.tokenizer import write_tokenizer

TARGET, DRAFT = "dense_31b_like", "assistant_plain"


def _edit_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config, indent=2))


def _refused(exc: type[MtpkitError], match: str | None, folders, **kwargs) -> MtpkitError:
    before = {str(f): tree_digest(f) for f in folders}
    with pytest.raises(exc, match=match) as info:
        load_pair(dtype="float32", device="cpu", **kwargs)
    assert {str(f): tree_digest(f) for f in folders} == before
    return info.value


def test_contaminated_draft(tiny, tiny_copy):
    draft = tiny_copy(DRAFT)
    _edit_config(draft, quantization_config={"quant_method": "modelopt", "quant_algo": "NVFP4"})
    # load_pair validates with `check`'s rules first: a PairCheckError whose finding names the fix.
    error = _refused(PairCheckError, "draft-quantization-config", [draft, tiny(TARGET)], target=tiny(TARGET),
                     draft=draft)
    (finding,) = [f for f in error.findings if f.severity == "error"]
    assert finding.id == "draft-quantization-config" and "`mtp-convert draft`" in finding.message
    # The assistant alone: a ConfigError that says how to write a clean one.
    with pytest.raises(ConfigError, match="mtp-convert draft") as info:
        load_draft(draft, dtype="float32", device="cpu")
    assert not isinstance(info.value, PairCheckError) and "quantization_config" in str(info.value)


def test_mismatched_pair(tiny):
    error = _refused(PairCheckError, "backbone-hidden-size", [tiny("e2b_like"), tiny(DRAFT)], target=tiny("e2b_like"),
                     draft=tiny(DRAFT))
    assert {"backbone-hidden-size", "kv-heads"} <= {f.id for f in error.findings if f.severity == "error"}


def test_different_tokenizer_in_the_draft(tiny_copy):
    target, draft = tiny_copy(TARGET), tiny_copy(DRAFT)
    write_tokenizer(target)
    write_tokenizer(draft, shift=1)  # same size and specials, other letters
    error = _refused(PairCheckError, r"the first, \[tokenizer\]: .*differs from", [target, draft], target=target,
                     draft=draft)
    assert [f.id for f in error.findings if f.severity == "error"] == ["tokenizer"]


def test_the_single_weights_file_is_missing(tiny, tiny_copy):
    target = tiny_copy(TARGET)
    (target / "model.safetensors").unlink()
    _refused(CheckpointError, "holds no weights", [target, tiny(DRAFT)], target=target, draft=tiny(DRAFT))


@pytest.mark.parametrize("damage", ["deleted", "misnamed"])
def test_a_shard_is_missing(tiny, cli, tmp_path, damage):
    target = tmp_path / "sharded"
    assert cli("reshard", tiny(TARGET), target, "--max-shard-size", "200KB").code == 0
    index = json.loads((target / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 2
    if damage == "deleted":
        (target / shards[-1]).unlink()
        missing = shards[-1]
    else:  # the index names a shard that was never written
        missing = "model-00009-of-00009.safetensors"
        index["weight_map"][next(iter(index["weight_map"]))] = missing
        (target / "model.safetensors.index.json").write_text(json.dumps(index))
    _refused(CheckpointError, f"names shard '{missing}', which is missing", [target, tiny(DRAFT)], target=target,
             draft=tiny(DRAFT))


@pytest.mark.parametrize(("quantization_config", "named"), [
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}, "awq"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
      "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
          "num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "symmetric": True,
          "dynamic": False}}}, "ignore": ["lm_head"]}, "int4 group"),
], ids=["awq", "ct-int4-group"])
def test_unsupported_quantization(tiny, tiny_copy, quantization_config, named):
    target = tiny_copy(TARGET)
    _edit_config(target, quantization_config=quantization_config)
    error = _refused(UnsupportedModelError, "not one the runtime runs", [target, tiny(DRAFT)], target=target,
                     draft=tiny(DRAFT))
    assert named in str(error) and isinstance(error, ConfigError)


def test_not_enough_memory(tiny):
    target, draft = tiny(TARGET), tiny(DRAFT)
    error = _refused(InsufficientMemoryError, "max-memory budget", [target, draft], target=target, draft=draft,
                     max_memory="1KB")
    assert str(target) in str(error)
    # The budget covers the target but not the assistant on top of it: the assistant is refused.
    need_target = model_bytes(open_checkpoint(target), torch.float32)
    need_draft = model_bytes(open_checkpoint(draft), torch.float32)
    error = _refused(InsufficientMemoryError, "max-memory budget", [target, draft], target=target, draft=draft,
                     max_memory=int(need_target * MARGIN) + 1)
    assert str(draft) in str(error)
    # Both fit: it loads.
    pair = load_pair(target=target, draft=draft, dtype="float32", device="cpu",
                     max_memory=int((need_target + need_draft) * MARGIN) + 2)
    assert pair.target.nbytes == need_target and pair.draft.nbytes == need_draft


def test_wrong_roles_and_not_a_pair_folder(tiny, tmp_path):
    _refused(ConfigError, "is a Gemma 4 assistant, not a target|is an assistant, not a target",
             [tiny(TARGET), tiny(DRAFT)], target=tiny(DRAFT), draft=tiny(TARGET))
    (tmp_path / "target").mkdir()
    _refused(ConfigError, "is not a pair folder", [tmp_path], pair_dir_or_repo=tmp_path)
    _refused(ConfigError, "give a pair folder or repo", [tiny(TARGET)], target=tiny(TARGET))


def test_bad_generate_arguments(tiny):
    pair = load_pair(target=tiny(TARGET), draft=tiny(DRAFT), dtype="float32", device="cpu")
    with pytest.raises(ConfigError, match="tokenizer"):
        pair.generate("hello", max_new_tokens=2)  # the fixture ships no tokenizer
    with pytest.raises(ConfigError, match=r"token ids in \[0, 128\)"):
        pair.generate([[5, 128]], max_new_tokens=2)
    with pytest.raises(ConfigError, match=">= 0"):
        pair.generate([[5, 6]], max_new_tokens=2, num_speculative_tokens=-1)
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        load_pair(target=tiny(TARGET), draft=tiny(DRAFT), dtype="float32", device="cpu", kv_cache_dtype="int8")
