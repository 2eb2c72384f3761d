"""Part-by-part loading (meta-device skeleton, one layer at a time) computes what transformers computes."""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma4ForCausalLM, Gemma4ForConditionalGeneration

from mtpkit.calibrate.layerwise import LayerwiseStream
from mtpkit.convert.checkpoint import open_checkpoint
from mtpkit.errors import CheckpointError
from mtpkit.loader.text_parts import TextCheckpoint


@pytest.mark.parametrize("name", ["e2b_like", "moe_26b_like", "dense_31b_like", "multimodal", "text_only"])
def test_layer_by_layer_logits_equal_transformers(tiny, name):
    folder = tiny(name)
    checkpoint = open_checkpoint(folder)
    cls = Gemma4ForConditionalGeneration if checkpoint.config["model_type"] == "gemma4" else Gemma4ForCausalLM
    reference = cls.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager",
                                    experts_implementation="eager").eval()
    g = torch.Generator().manual_seed(5)
    sequences = [torch.randint(3, 120, (n,), generator=g) for n in (11, 4)]  # past the sliding window of 8
    stream = LayerwiseStream(TextCheckpoint(checkpoint, dtype=torch.float32), sequences)
    for i in range(stream.num_layers):
        stream.run_layer(i)
        assert all(p.is_meta for p in stream.model.layers[i].parameters())  # released once run
        owning = [j for j in range(i + 1) if stream.caches[0].k[j] is not None and not stream.caches[0].k[j].is_meta]
        assert all(stream.last_reader[j] > i for j in owning)  # only caches a later layer reads are kept
    for b, tokens in enumerate(sequences):
        with torch.no_grad():
            theirs = reference(tokens[None]).logits[0]
        torch.testing.assert_close(stream.logits(b), theirs, rtol=1e-5, atol=1e-5)


def test_a_missing_layer_tensor_names_it(tiny_copy):
    from safetensors.torch import load_file, save_file

    folder = tiny_copy("dense_31b_like")
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, folder / "model.safetensors")
    text = TextCheckpoint(open_checkpoint(folder))
    model = text.skeleton()
    with pytest.raises(CheckpointError, match=r"layers\.1: .*missing \['mlp\.up_proj\.weight'\]"):
        text.load(model, "layers.1")
