"""TextConfig, KVCache layout and load_text_state_dict: against transformers' config and the fixtures."""

from __future__ import annotations

import dataclasses

import copy
import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from mtpkit.errors import ConfigError
from mtpkit.runtime import Gemma4TextModel, KVCache, TextConfig, load_text_state_dict
from mtpkit.runtime.rope import inv_freq
from tests.conftest import EXAMPLES

S, F = "sliding_attention", "full_attention"


def _config(tiny, name: str) -> dict:
    return json.loads((tiny(name) / "config.json").read_text())


@pytest.mark.parametrize("name", ["e2b_like", "moe_26b_like", "dense_31b_like", "multimodal", "text_only"])
def test_fields_match_transformers(tiny, name):
    config = TextConfig.from_dict(_config(tiny, name))
    text = AutoConfig.from_pretrained(tiny(name)).get_text_config()
    assert config.layer_types == tuple(text.layer_types)
    for layer in range(config.num_hidden_layers):
        spec, theirs = config.spec(layer), text.per_layer_config[layer]
        assert (spec.head_dim, spec.num_key_value_heads) == (theirs.head_dim, theirs.num_key_value_heads)
        modes = text.kv_sharing_modes
        assert config.is_kv_shared(layer) == (modes[layer] == "reuse")
        if modes[layer] == "reuse":  # the last non-shared layer of the same type stores what it reads
            source = config.kv_source[layer]
            assert modes[source] == "store" and text.layer_types[source] == text.layer_types[layer]
    for field in ("vocab_size", "hidden_size", "sliding_window", "rms_norm_eps", "final_logit_softcapping",
                  "hidden_size_per_layer_input", "num_experts", "top_k_experts", "moe_intermediate_size"):
        assert getattr(config, field) == getattr(text, field), field


def test_e2b_like_sharing_map(tiny):
    config = TextConfig.from_dict(_config(tiny, "e2b_like"))
    # Unshared layers S,S,F,S: the sliding store is layer 3, the full store layer 2 (not the last).
    assert config.kv_source == (0, 1, 2, 3, 3, 2, 2)
    assert [config.mlp_intermediate_size(i) for i in range(7)] == [64] * 4 + [128] * 3


def test_rope_frequencies_match_transformers(tiny):
    from transformers import Gemma4ForCausalLM

    ref = Gemma4ForCausalLM.from_pretrained(tiny("e2b_like"))
    config = TextConfig.from_dict(_config(tiny, "e2b_like"))
    for layer_type, spec in config.attention.items():
        theirs = getattr(ref.model.rotary_emb, f"{layer_type}_inv_freq")
        assert torch.equal(inv_freq(spec), theirs)
    full = inv_freq(config.attention[F])
    assert full.shape == (8,) and (full[2:] == 0).all() and (full[:2] > 0).all()  # 25 % of 16 dims rotate


def test_flat_and_nested_read_the_same(tiny):
    nested = _config(tiny, "multimodal")
    flat = {**nested["text_config"], "tie_word_embeddings": nested["tie_word_embeddings"]}
    # The only difference: the wrapper's media placeholder ids, which a text-only config does not have.
    media = tuple(nested[k] for k in ("image_token_id", "video_token_id", "audio_token_id"))
    assert dataclasses.replace(TextConfig.from_dict(flat), media_token_ids=media) == TextConfig.from_dict(nested)


def test_flat_head_dim_dialect(tiny):
    """Google's published spelling (global_head_dim, no per_layer_config) reads the same."""
    config = _config(tiny, "dense_31b_like")
    flat = {k: v for k, v in config.items() if k != "per_layer_config"}
    assert TextConfig.from_dict(flat) == TextConfig.from_dict(config)


@pytest.mark.parametrize(("model", "producers"), [("E2B", (13, 14)), ("E4B", (22, 23)), ("26B-A4B", (28, 29)),
                                                  ("31B", (58, 59))])
def test_published_configs(model, producers):
    config = TextConfig.from_dict(json.loads((EXAMPLES / f"gemma-4-{model}-it" / "config.json").read_text()))
    shared = range(config.first_kv_shared_layer, config.num_hidden_layers)
    assert {config.kv_source[i] for i in shared} <= set(producers)
    full = config.attention[F]
    assert (full.head_dim, full.rope_type, full.partial_rotary_factor) == (512, "proportional", 0.25)


@pytest.mark.parametrize(("change", "message"), [
    (lambda c: c.update(layer_types=[S, F, S, F, S, F, S]), "ends in 'sliding_attention'"),
    (lambda c: c["rope_parameters"][F].update(rope_type="yarn"), "rope_type is 'yarn'"),
    (lambda c: c.update(use_bidirectional_attention="all"), "not a causal decoder"),
    (lambda c: c.update(hidden_activation="relu"), "hidden_activation is 'relu'"),
    (lambda c: c.update(num_kv_shared_layers=7), "needs at least one layer"),
])
def test_refusals(tiny, change, message):
    config = copy.deepcopy(_config(tiny, "e2b_like"))
    change(config)
    with pytest.raises(ConfigError, match=message):
        TextConfig.from_dict(config)


def test_cache_layout(tiny):
    config = TextConfig.from_dict(_config(tiny, "e2b_like"))
    cache = KVCache(config, 2, 10, dtype=torch.bfloat16)
    assert [k is None for k in cache.k] == [False] * 4 + [True] * 3
    assert cache.k[2].shape == (2, 2, 10, 16) and cache.k[3].shape == (2, 2, 10, 8)
    assert cache.read(6)[0] is cache.k[2] and cache.read(4)[1] is cache.v[3]
    k = torch.randn(2, 2, 3, 8)
    positions = torch.tensor([[0, 1, 2], [5, 6, 7]])
    keys, _ = cache.update(3, positions, k, k)
    assert torch.equal(keys[0, :, :3], k[0].bfloat16()) and torch.equal(keys[1, :, 5:8], k[1].bfloat16())
    assert (keys[0, :, 3:] == 0).all() and (keys[1, :, :5] == 0).all()
    with pytest.raises(ValueError, match="KV-shared"):
        cache.update(5, positions, k, k)


def test_load_is_strict(tiny):
    folder = tiny("moe_26b_like")
    config = TextConfig.from_dict(_config(tiny, "moe_26b_like"))
    tensors = load_file(folder / "model.safetensors")
    assert "model.layers.1.self_attn.v_proj.weight" not in tensors  # K=V full layer
    model = Gemma4TextModel(config)
    load_text_state_dict(model, tensors)
    assert torch.equal(model.layers[0].experts.gate_up_proj, tensors["model.layers.0.experts.gate_up_proj"].float())

    missing = {k: v for k, v in tensors.items() if k != "model.layers.0.router.scale"}
    with pytest.raises(ValueError, match=r"missing \['model.layers.0.router.scale'\]"):
        load_text_state_dict(model, missing)
    extra = {**tensors, "model.layers.1.self_attn.v_proj.weight": torch.zeros(16, 32)}
    with pytest.raises(ValueError, match=r"unexpected \['model.layers.1.self_attn.v_proj.weight'\]"):
        load_text_state_dict(model, extra)
    wrong = {**tensors, "model.norm.weight": torch.zeros(31)}
    with pytest.raises(ValueError, match=r"model.norm.weight \(31,\)"):
        load_text_state_dict(model, wrong)


def test_multimodal_load_ignores_the_vision_tower(tiny):
    tensors = load_file(tiny("multimodal") / "model.safetensors")
    assert any(k.startswith("model.vision_tower.") for k in tensors)
    model = Gemma4TextModel(TextConfig.from_dict(_config(tiny, "multimodal")))
    load_text_state_dict(model, tensors)
    assert torch.equal(model.norm.weight, tensors["model.language_model.norm.weight"].float())
