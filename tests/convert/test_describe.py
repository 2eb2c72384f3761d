"""`inspect` facts on tiny checkpoints, checked against transformers (the model) and safetensors (the files)."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoConfig
from transformers.models.gemma4_assistant import Gemma4AssistantForCausalLM

from mtpkit.convert.checkpoint import open_checkpoint
from mtpkit.convert.describe import describe
from tests.conftest import EXAMPLES

MODEL_CLASS = {
    "e2b_like": transformers.Gemma4ForCausalLM,
    "moe_26b_like": transformers.Gemma4ForCausalLM,
    "dense_31b_like": transformers.Gemma4ForCausalLM,
    "text_only": transformers.Gemma4ForCausalLM,
    "multimodal": transformers.Gemma4ForConditionalGeneration,
    "assistant_centroids": Gemma4AssistantForCausalLM,
    "assistant_plain": Gemma4AssistantForCausalLM,
}


@pytest.mark.parametrize("name", MODEL_CLASS)
def test_inspect_json_matches_the_files_and_transformers(tiny, cli, name):
    folder = tiny(name)
    result = cli("inspect", folder, "--json")
    assert result.code == 0, result.err
    facts = json.loads(result.out)

    model = MODEL_CLASS[name].from_pretrained(folder)
    assert facts["num_parameters"] == model.num_parameters()
    with safe_open(folder / "model.safetensors", "pt") as f:
        names = list(f.keys())
        assert facts["num_tensors"] == len(names)
        dtypes: dict[str, int] = {}
        for key in names:
            dtypes[f.get_slice(key).get_dtype()] = dtypes.get(f.get_slice(key).get_dtype(), 0) + 1
    assert {k: v["tensors"] for k, v in facts["dtypes"].items()} == dtypes
    assert facts["total_bytes"] == sum(t.numel() * t.element_size() for t in load_file(folder / "model.safetensors").values())
    assert facts["shards"] == 1 and facts["config_only"] is False and facts["family"] == "gemma4"

    config = AutoConfig.from_pretrained(folder)
    text = config.get_text_config()
    if name.startswith("assistant"):
        assert facts["role"] == "assistant" and facts["kv_producers"] is None
        assert facts["assistant"]["backbone_hidden_size"] == config.backbone_hidden_size
        assert facts["assistant"]["use_ordered_embeddings"] == config.use_ordered_embeddings
    else:
        assert facts["role"] == "target"
        stores = {text.layer_types[i]: i for i, m in enumerate(text.kv_sharing_modes) if m == "store"}
        assert facts["kv_producers"] == stores
    assert facts["layer_types"] == {t: text.layer_types.count(t) for t in sorted(set(text.layer_types), reverse=True)}
    assert facts["architecture"]["hidden_size"] == text.hidden_size
    assert facts["quantization"] is None and facts["warnings"] == []


def test_e2b_like_has_its_structure(tiny, cli):
    facts = json.loads(cli("inspect", tiny("e2b_like"), "--json").out)
    # Unshared layers 0-3 are S,S,F,S: the full producer is layer 2, not the last unshared layer.
    assert facts["kv_producers"] == {"sliding_attention": 3, "full_attention": 2}
    assert facts["architecture"]["num_kv_shared_layers"] == 3
    # transformers 5.24's save_pretrained writes the per-layer dialect.
    assert facts["config_form"] == {"text_config": "flat", "head_dims": "per_layer_config"}


def test_config_only_reference_folders(cli):
    facts = json.loads(cli("inspect", EXAMPLES / "gemma-4-26B-A4B-it-assistant", "--json").out)
    assert facts["config_only"] is True and facts["num_parameters"] is None and facts["num_tensors"] == 0
    assert facts["config_form"] == {"text_config": "nested", "head_dims": "global_head_dim"}
    assert facts["assistant"] == {"backbone_hidden_size": 2816, "use_ordered_embeddings": False,
                                  "num_centroids": 2048, "centroid_intermediate_top_k": 32,
                                  "tie_word_embeddings": True}


def test_table_output_names_the_producers(cli):
    result = cli("inspect", EXAMPLES / "gemma-4-31B-it")
    assert result.code == 0 and "sliding_attention 58, full_attention 59" in result.out


def test_assistant_problems_are_warned(tiny_copy, cli):
    folder = tiny_copy("assistant_plain")
    config = json.loads((folder / "config.json").read_text())
    flat = {**config.pop("text_config"), **config, "model_type": "gemma4_mtp",
            "quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4", "kv_cache_quant_algo": "FP8"}}
    (folder / "config.json").write_text(json.dumps(flat))
    result = cli("inspect", folder, "--json")
    assert result.code == 0
    assert json.loads(result.out)["role"] == "assistant"
    assert "gemma4_mtp" in result.err and "text_config" in result.err and "quantization config" in result.err


def test_packed_fp4_weights_count_two_parameters_per_byte(tmp_path):
    out_features, in_features = 32, 64
    config = {"model_type": "gemma4_text", "num_hidden_layers": 1, "layer_types": ["full_attention"]}
    layouts = {
        "ct": {"p.weight_packed": torch.zeros(out_features, in_features // 2, dtype=torch.uint8),
               "p.weight_scale": torch.zeros(out_features, in_features // 16, dtype=torch.float8_e4m3fn),
               "p.weight_global_scale": torch.ones(1), "p.input_global_scale": torch.ones(1)},
        "modelopt": {"p.weight": torch.zeros(out_features, in_features // 2, dtype=torch.uint8),
                     "p.weight_scale": torch.zeros(out_features, in_features // 16, dtype=torch.float8_e4m3fn),
                     "p.weight_scale_2": torch.ones(()), "p.input_scale": torch.ones(())},
    }
    for name, tensors in layouts.items():
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config))
        save_file(tensors, folder / "model.safetensors")
        assert describe(open_checkpoint(folder)).num_parameters == out_features * in_features


@pytest.mark.parametrize(("model", "producers"), [("E2B", (13, 14)), ("E4B", (22, 23)), ("26B-A4B", (28, 29)),
                                                  ("31B", (58, 59))])
def test_inspect_json_on_the_full_size_reference_configs(cli, model, producers):
    """The published KV producers (sliding / full) of the four public pairs, through the CLI."""
    result = cli("inspect", EXAMPLES / f"gemma-4-{model}-it", "--json")
    assert result.code == 0 and result.err == ""
    facts = json.loads(result.out)
    assert facts["kv_producers"] == {"sliding_attention": producers[0], "full_attention": producers[1]}
    assert (facts["role"], facts["family"], facts["quantization"]) == ("target", "gemma4", None)
    assistant = json.loads(cli("inspect", EXAMPLES / f"gemma-4-{model}-it-assistant", "--json").out)
    assert assistant["role"] == "assistant" and assistant["kv_producers"] is None
    # The assistant was trained on this target's hidden size.
    assert assistant["assistant"]["backbone_hidden_size"] == facts["architecture"]["hidden_size"]
