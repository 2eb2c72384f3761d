"""`check` on the published pairs (config-only), on tiny pairs transformers can run, and on broken pairs."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, preset_name_to_scheme
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from mtpkit.formats.gemma4 import attention_geometry, text_config_of
from tests.conftest import EXAMPLES

MODELS = ("E2B", "E4B", "26B-A4B", "31B")
# Published text hidden sizes of the four targets (and so the backbone sizes of their assistants).
HIDDEN = {"E2B": 1536, "E4B": 2560, "26B-A4B": 2816, "31B": 5376}


def _check(cli, target, draft):
    result = cli("check", "--target", target, "--draft", draft, "--json")
    return result, json.loads(result.out) if result.out else None


@pytest.mark.parametrize("model", MODELS)
def test_published_pairs_pass_config_only(cli, model):
    result, report = _check(cli, EXAMPLES / f"gemma-4-{model}-it", EXAMPLES / f"gemma-4-{model}-it-assistant")
    assert result.code == 0 and report["ok"] and report["findings"] == []


@pytest.mark.parametrize(("target", "draft"), list(itertools.permutations(MODELS, 2)))
def test_mismatched_published_pairs_fail_with_the_right_ids(cli, target, draft):
    result, report = _check(cli, EXAMPLES / f"gemma-4-{target}-it", EXAMPLES / f"gemma-4-{draft}-it-assistant")
    ids = {f["id"] for f in report["findings"]}
    assert result.code == 1 and not report["ok"]
    assert "backbone-hidden-size" in ids  # the four hidden sizes are all different
    # The 31B assistant reads K=V full-attention caches with 4 KV heads and a 1024 window; E2B's has neither.
    if (target, draft) == ("E2B", "31B"):
        assert {"kv-k-eq-v", "kv-heads", "sliding-window"} <= ids


def test_geometry_matches_transformers_per_layer_config():
    """Our reading of head dims and KV heads per attention type equals what transformers resolves per layer."""
    for model in MODELS:
        for suffix in ("-it", "-it-assistant"):
            folder = EXAMPLES / f"gemma-4-{model}{suffix}"
            text, prefix = text_config_of(json.loads((folder / "config.json").read_text()))
            ours = attention_geometry(text, prefix=prefix)
            reference = AutoConfig.from_pretrained(folder).get_text_config()
            for index, layer_type in enumerate(reference.layer_types):
                layer = reference.per_layer_config[index]
                assert (layer.head_dim, layer.num_key_value_heads) == (
                    ours[layer_type]["head_dim"], ours[layer_type]["num_key_value_heads"]), (folder, index)


@pytest.mark.parametrize(("target", "draft"), [("e2b_like", "assistant_centroids"), ("dense_31b_like", "assistant_plain")])
def test_tiny_pairs_that_transformers_runs_pass(tiny, cli, target, draft):
    # tests/fixtures/test_gemma4_tiny.py shows transformers' assisted generation equals greedy for these pairs.
    result, report = _check(cli, tiny(target), tiny(draft))
    assert result.code == 0 and report["ok"], result.out


def test_tiny_mismatch_names_both_files(tiny, cli):
    result, report = _check(cli, tiny("e2b_like"), tiny("assistant_plain"))
    assert result.code == 1
    message = next(f["message"] for f in report["findings"] if f["id"] == "backbone-hidden-size")
    assert str(tiny("assistant_plain") / "config.json") in message and str(tiny("e2b_like") / "config.json") in message


def test_broken_drafts(tiny, tiny_copy, cli):
    draft = tiny_copy("assistant_centroids")
    config = json.loads((draft / "config.json").read_text())
    config["model_type"] = "gemma4_mtp"
    config["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "NVFP4"}
    (draft / "config.json").write_text(json.dumps(config))
    tensors = load_file(draft / "model.safetensors")
    tensors["masked_embedding.token_ordering"][0] = tensors["masked_embedding.token_ordering"][1]  # not a permutation
    tensors["model.layers.0.mlp.down_proj.weight"] = tensors["model.layers.0.mlp.down_proj.weight"][:, :8].clone()
    save_file(tensors, draft / "model.safetensors")
    (draft / "tokenizer.json").write_text('{"model": "draft"}')
    target = tiny_copy("e2b_like")
    (target / "tokenizer.json").write_text('{"model": "target"}')
    result, report = _check(cli, target, draft)
    ids = {f["id"] for f in report["findings"]}
    assert result.code == 1
    assert {"draft-model-type", "draft-quantization-config", "token-ordering", "draft-shapes", "tokenizer"} <= ids


def test_declared_fp8_kv_cache_without_scales_is_a_warning(tiny, tiny_copy, cli):
    target = tiny_copy("dense_31b_like")
    config = json.loads((target / "config.json").read_text())
    kv = QuantizationArgs(num_bits=8, type="float", strategy="tensor", dynamic=False, symmetric=True)
    qc = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme("FP8_DYNAMIC", ["Linear"])},
                            kv_cache_scheme=kv, format="float-quantized")
    config["quantization_config"] = json.loads(json.dumps(qc.to_dict(), default=str))
    (target / "config.json").write_text(json.dumps(config))
    result, report = _check(cli, target, tiny("assistant_plain"))
    assert result.code == 0 and [f["id"] for f in report["findings"]] == ["kv-scales-missing"]
    assert report["findings"][0]["severity"] == "warning"
    tensors = load_file(target / "model.safetensors")
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor(0.01)
    save_file(tensors, target / "model.safetensors")
    result, report = _check(cli, target, tiny("assistant_plain"))
    assert result.code == 0 and report["findings"] == []


def test_unusable_input_exits_2(cli, tmp_path):
    result = cli("check", "--target", tmp_path / "nope", "--draft", tmp_path / "nope2")
    assert result.code == 2 and result.err.startswith("mtp-convert: error: ")
    result = cli("check", tmp_path)
    assert result.code == 2 and "has no target/ folder" in result.err
