"""The broken-assistant corpus for `mtp-convert draft`: each case damages a private copy of a tiny assistant.

`tests/convert/test_draft_corpus.py` drafts every case and checks the result against transformers.
Builders only edit config.json, add/remove files, or rewrite tensors with safetensors; they never call mtpkit.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

PLAIN, CENTROIDS = "assistant_plain", "assistant_centroids"
TARGET_OF = {PLAIN: "dense_31b_like", CENTROIDS: "e2b_like"}  # the tiny target each assistant was built for
WEIGHTS = "model.safetensors"
QUANT_KEYS = ("quantization_config", "compression_config", "kv_cache_scheme")
FLAT_KEYS = ("global_head_dim", "num_global_key_value_heads")
ASSISTANT_KEYS = ("backbone_hidden_size", "use_ordered_embeddings", "num_centroids", "centroid_intermediate_top_k")


# ----------------------------------------------------------------------------------------------- editing helpers


def read_config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


def write_config(folder: Path, config: dict) -> None:
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def edit_config(folder: Path, change: Callable[[dict], None]) -> None:
    config = read_config(folder)
    change(config)
    write_config(folder, config)


def edit_tensors(folder: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> None:
    tensors = load_file(folder / WEIGHTS)
    change(tensors)
    save_file(tensors, folder / WEIGHTS, metadata={"format": "pt"})


def flatten(config: dict) -> None:
    """Every text_config field at the top level (assistant fields win where both levels have one)."""
    text = config.pop("text_config")
    for key, value in text.items():
        config.setdefault(key, value)


def only_per_layer_dialect(config: dict) -> None:
    """What transformers 5.24 itself saves: per_layer_config alone, no flat head-dim keys."""
    for key in FLAT_KEYS:
        del config["text_config"][key]


def nvfp4_compressed_tensors() -> dict:
    """quantization_config exactly as llm-compressor writes it for preset NVFP4 (through JSON, as on disk)."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, preset_name_to_scheme

    kv = QuantizationArgs(num_bits=8, type="float", strategy="tensor", dynamic=False, symmetric=True)
    qc = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme("NVFP4", ["Linear"])},
                            format="nvfp4-pack-quantized", ignore=["lm_head"], kv_cache_scheme=kv)
    return json.loads(json.dumps(qc.to_dict(), default=str))


# ModelOpt's flat form in config.json, and the hf_quant_config.json of NVIDIA's published NVFP4 checkpoints.
MODELOPT_FLAT = {"quant_method": "modelopt", "quant_algo": "NVFP4", "kv_cache_quant_algo": "FP8", "group_size": 16,
                 "exclude_modules": ["lm_head", "model.vision_tower*"]}
HF_QUANT_CONFIG = {"producer": {"name": "modelopt", "version": "0.35.0"},
                   "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": "FP8", "group_size": 16,
                                    "exclude_modules": ["lm_head", "model.vision_tower*"]}}


# ----------------------------------------------------------------------------------------------- cases


@dataclass(frozen=True)
class Case:
    id: str
    base: str  # PLAIN or CENTROIDS: tiny_copy(base) is damaged by `edit`
    edit: Callable[[Path], None]
    rules: tuple[str, ...]  # rule ids that OUT/mtpkit_draft.json must record
    args: tuple[str, ...] = ()  # extra `draft` arguments
    expect: dict = field(default_factory=dict)  # {"key" or "text_config.key": value} the output config must hold
    out_dtype: torch.dtype = torch.bfloat16  # the dtype of OUT's float tensors
    # What OUT must equal under transformers: "clean" (the undamaged tiny fixture) or "input" (the damaged copy,
    # where it is itself a sound model that transformers loads: a grown model, or FP32 weights kept FP32).
    reference: str = "clean"
    same_model: bool = True  # OUT computes exactly what the reference computes (False: a lossy --dtype cast)


def _cfg(change: Callable[[dict], None]) -> Callable[[Path], None]:
    return lambda folder: edit_config(folder, change)


def _flattened(config: dict) -> None:
    flatten(config)


def _flattened_text_type(config: dict) -> None:
    flatten(config)
    config["model_type"] = "gemma4_text"
    config["architectures"] = ["Gemma4ForCausalLM"]


def _top_level_intermediate(config: dict) -> None:
    config["intermediate_size"] = 4096  # stale top-level copy; text_config still says 64, as the weights do


def _nested_intermediate(config: dict) -> None:
    config["text_config"]["intermediate_size"] = 4096  # the weights say 64


def _both_intermediate(config: dict) -> None:
    config["intermediate_size"] = 4096
    config["text_config"]["intermediate_size"] = 128  # neither copy is what the weights say


def _ct_quantization(config: dict) -> None:
    config["quantization_config"] = nvfp4_compressed_tensors()
    config["text_config"]["quantization_config"] = nvfp4_compressed_tensors()


def _other_quant_keys(config: dict) -> None:
    qc = nvfp4_compressed_tensors()
    config["compression_config"] = qc
    config["text_config"]["kv_cache_scheme"] = qc["kv_cache_scheme"]
    config["kv_cache_scheme"] = qc["kv_cache_scheme"]


def _modelopt_flat(config: dict) -> None:
    config["quantization_config"] = dict(MODELOPT_FLAT)


def _hf_quant_file(folder: Path) -> None:
    (folder / "hf_quant_config.json").write_text(json.dumps(HF_QUANT_CONFIG, indent=2) + "\n")


def _mtp_type(config: dict) -> None:
    config["model_type"] = "gemma4_mtp"
    config["architectures"] = ["Gemma4MTPModel"]


def _set(path: str, value) -> Callable[[dict], None]:
    def change(config: dict) -> None:
        holder = config["text_config"] if path.startswith("text_config.") else config
        holder[path.removeprefix("text_config.")] = value
    return change


def _fp32(folder: Path) -> None:
    edit_tensors(folder, lambda t: t.update({k: v.float() for k, v in t.items() if v.is_floating_point()}))
    edit_config(folder, _set("dtype", "float32"))


def _eleven_layers(folder: Path) -> None:
    """Grow the 2-layer assistant to 11 layers (S x10 + F at 1 and 10) by copying layer tensors, then save the
    config through transformers itself, which writes per_layer_config with zero-padded keys ("01", "10")."""
    from transformers.models.gemma4_assistant import Gemma4AssistantConfig

    types = ["sliding_attention"] * 11
    types[1] = types[10] = "full_attention"

    def grow(tensors: dict[str, torch.Tensor]) -> None:
        for i, layer_type in enumerate(types):
            source = 0 if layer_type == "sliding_attention" else 1
            for name in [n for n in tensors if n.startswith(f"model.layers.{source}.")]:
                tensors[name.replace(f"model.layers.{source}.", f"model.layers.{i}.", 1)] = tensors[name].clone()

    edit_tensors(folder, grow)
    config = read_config(folder)
    only_per_layer_dialect(config)
    text = config["text_config"]
    text.update(num_hidden_layers=11, num_kv_shared_layers=11, layer_types=types)
    text["per_layer_config"] = {str(i): dict(text["per_layer_config"]["1"]) for i in (1, 10)}
    Gemma4AssistantConfig.from_dict(config).save_pretrained(folder)


def _ordered_without_centroids(config: dict) -> None:
    config["use_ordered_embeddings"] = True  # assistant_plain holds no masked_embedding tensors


def _fp8(folder: Path) -> None:
    def change(t: dict[str, torch.Tensor]) -> None:
        t["model.layers.0.mlp.down_proj.weight"] = t["model.layers.0.mlp.down_proj.weight"].float().to(
            torch.float8_e4m3fn)
        t["model.layers.0.mlp.down_proj.weight_scale"] = torch.ones(1, dtype=torch.float32)
    edit_tensors(folder, change)


def _nvfp4_packed(folder: Path) -> None:
    """compressed-tensors' nvfp4-pack-quantized layout of one Linear (packed uint8 weight, FP8 scales)."""
    def change(t: dict[str, torch.Tensor]) -> None:
        prefix = "model.layers.0.mlp.down_proj."
        rows, cols = t.pop(prefix + "weight").shape
        t[prefix + "weight_packed"] = torch.zeros(rows, cols // 2, dtype=torch.uint8)
        t[prefix + "weight_scale"] = torch.ones(rows, cols // 16, dtype=torch.float8_e4m3fn)
        t[prefix + "weight_global_scale"] = torch.ones(1, dtype=torch.float32)
    edit_tensors(folder, change)


def _shrink_vocab(folder: Path) -> None:
    name = "model.embed_tokens.weight"
    edit_tensors(folder, lambda t: t.update({name: t[name][:120].clone()}))  # 120 tokens; the target has 128


def _duplicate_token(folder: Path) -> None:
    def change(t: dict[str, torch.Tensor]) -> None:
        ordering = t["masked_embedding.token_ordering"].clone()
        ordering[1] = ordering[0]  # one token twice, another never: not a permutation
        t["masked_embedding.token_ordering"] = ordering
    edit_tensors(folder, change)


def _top_right_nested_wrong(config: dict) -> None:
    config["intermediate_size"] = 64  # the top-level copy is the right one this time
    config["text_config"]["intermediate_size"] = 4096


def _nested_assistant_field(config: dict) -> None:
    config["text_config"]["backbone_hidden_size"] = config.pop("backbone_hidden_size")


def _inherited_invariants(config: dict) -> None:
    """Copied from an E2B-style target: PLE, MoE and double-wide MLP switched on."""
    config["text_config"].update(hidden_size_per_layer_input=256, vocab_size_per_layer_input=262144,
                                 enable_moe_block=True, use_double_wide_mlp=True)


def _legacy_torch_dtype(config: dict) -> None:
    config["torch_dtype"] = config.pop("dtype")


def _layers(count: int, flat_only: bool) -> Callable[[dict], None]:
    def change(config: dict) -> None:
        if flat_only:
            del config["text_config"]["per_layer_config"]
        config["text_config"]["num_hidden_layers"] = count  # the tensors hold layers 0-1
    return change


def _per_layer_variants() -> list[Case]:
    """As transformers 5.24 saves it (flat keys and per_layer_config), and per_layer_config alone."""
    cases = []
    for base in (PLAIN, CENTROIDS):
        name = base.split("_")[1]
        cases += [Case(f"as-saved-{name}", base, lambda folder: None, ("head-dim-dialect",)),
                  Case(f"per-layer-only-{name}", base, _cfg(only_per_layer_dialect), ("head-dim-dialect",),
                       expect={"text_config.global_head_dim": 16})]
    return cases


# Repaired: `draft` exits 0 and OUT is canonical, loadable by transformers, and accepted by `check`.
REPAIRED: list[Case] = [
    Case("flattened", PLAIN, _cfg(_flattened), ("nest-text-config",)),
    Case("flattened-centroids", CENTROIDS, _cfg(_flattened), ("nest-text-config",)),
    Case("top-level-intermediate-size", PLAIN, _cfg(_top_level_intermediate), ("remove-stale-top-level",),
         expect={"text_config.intermediate_size": 64}),
    Case("nested-intermediate-size", PLAIN, _cfg(_nested_intermediate), ("shape-decides",),
         expect={"text_config.intermediate_size": 64}),
    Case("both-intermediate-sizes-wrong", PLAIN, _cfg(_both_intermediate), ("shape-decides", "remove-stale-top-level"),
         expect={"text_config.intermediate_size": 64}),
    Case("compressed-tensors-nvfp4", PLAIN, _cfg(_ct_quantization), ("strip-quantization",)),
    Case("compression-config-kv-cache-scheme", CENTROIDS, _cfg(_other_quant_keys), ("strip-quantization",)),
    Case("modelopt-flat-quantization-config", CENTROIDS, _cfg(_modelopt_flat), ("strip-quantization",)),
    Case("hf-quant-config-file", PLAIN, _hf_quant_file, ("strip-quantization",)),
    Case("gemma4-mtp-model-type", CENTROIDS, _cfg(_mtp_type), ("model-type",)),
    Case("gemma4-text-flattened", PLAIN, _cfg(_flattened_text_type), ("model-type", "nest-text-config")),
    *_per_layer_variants(),
    Case("per-layer-only-zero-padded", PLAIN, _eleven_layers, ("head-dim-dialect",), reference="input",
         expect={"text_config.global_head_dim": 16, "text_config.num_global_key_value_heads": 1}),
    Case("fp32-weights", CENTROIDS, _fp32, ("cast-dtype",), expect={"dtype": "bfloat16"}),
    Case("fp32-weights-keep", CENTROIDS, _fp32, (), args=("--dtype", "float32"), expect={"dtype": "float32"},
         out_dtype=torch.float32, reference="input"),
    Case("backbone-hidden-size", PLAIN, _cfg(_set("backbone_hidden_size", 999)), ("shape-decides",),
         expect={"backbone_hidden_size": 48}),
    Case("num-centroids", CENTROIDS, _cfg(_set("num_centroids", 16)), ("shape-decides",), expect={"num_centroids": 8}),
    Case("ordered-embeddings-without-centroids", PLAIN, _cfg(_ordered_without_centroids), ("shape-decides",),
         expect={"use_ordered_embeddings": False}),
    Case("num-kv-shared-layers-zero", CENTROIDS, _cfg(_set("text_config.num_kv_shared_layers", 0)),
         ("assistant-invariant",), expect={"text_config.num_kv_shared_layers": 2}),
    # More of "the tensors decide", and the other rules.
    Case("top-right-nested-wrong-intermediate", PLAIN, _cfg(_top_right_nested_wrong),
         ("shape-decides", "remove-stale-top-level"), expect={"text_config.intermediate_size": 64}),
    Case("head-dim", PLAIN, _cfg(_set("text_config.head_dim", 16)), ("shape-decides",),
         expect={"text_config.head_dim": 8}),
    Case("num-attention-heads", CENTROIDS, _cfg(_set("text_config.num_attention_heads", 8)), ("shape-decides",),
         expect={"text_config.num_attention_heads": 4}),
    Case("hidden-size", PLAIN, _cfg(_set("text_config.hidden_size", 64)), ("shape-decides",),
         expect={"text_config.hidden_size": 32}),
    Case("vocab-size-in-config", CENTROIDS, _cfg(_set("text_config.vocab_size", 256)), ("shape-decides",),
         expect={"text_config.vocab_size": 128}),
    Case("num-hidden-layers-flat", PLAIN, _cfg(_layers(3, flat_only=True)), ("shape-decides",),
         expect={"text_config.num_hidden_layers": 2}),
    Case("num-hidden-layers-as-saved", PLAIN, _cfg(_layers(3, flat_only=False)), ("shape-decides",),
         expect={"text_config.num_hidden_layers": 2}),
    Case("ordered-embeddings-false-with-centroids", CENTROIDS, _cfg(_set("use_ordered_embeddings", False)),
         ("shape-decides",), expect={"use_ordered_embeddings": True}),
    Case("assistant-field-in-text-config", CENTROIDS, _cfg(_nested_assistant_field), ("unnest-assistant-field",),
         expect={"backbone_hidden_size": 64}),
    Case("inherited-target-invariants", CENTROIDS, _cfg(_inherited_invariants), ("assistant-invariant",)),
    Case("text-config-model-type-missing", PLAIN, _cfg(lambda c: c["text_config"].pop("model_type")),
         ("model-type",)),
    Case("architectures-missing", CENTROIDS, _cfg(lambda c: c.pop("architectures")), ("model-type",)),
    Case("tie-word-embeddings-missing", CENTROIDS, _cfg(lambda c: c.pop("tie_word_embeddings")),
         ("assistant-default",), expect={"tie_word_embeddings": True}),
    Case("legacy-torch-dtype", PLAIN, _cfg(_legacy_torch_dtype), ("dtype",), expect={"dtype": "bfloat16"}),
    Case("dtype-float16", CENTROIDS, lambda folder: None, ("cast-dtype", "dtype"), args=("--dtype", "float16"),
         expect={"dtype": "float16"}, out_dtype=torch.float16, same_model=False),
]


@dataclass(frozen=True)
class Unfixable:
    """`draft` cannot repair it: it refuses (exit 2, one line), or `check` on its output fails with `check_id`."""

    id: str
    base: str
    edit: Callable[[Path], None]
    check_id: str | None = None  # None: draft itself must refuse
    message: str = ""  # a substring draft's one-line error must contain


UNFIXABLE: list[Unfixable] = [
    Unfixable("vocab-mismatch", PLAIN, _shrink_vocab, check_id="vocab-size"),
    Unfixable("token-ordering-duplicate", CENTROIDS, _duplicate_token, check_id="token-ordering"),
    Unfixable("fp8-tensors", PLAIN, _fp8, message="quantized"),
    Unfixable("nvfp4-packed-tensors", PLAIN, _nvfp4_packed, message="quantized"),
]


def grown_vocab(folder: Path, vocab: int = 512) -> None:
    """assistant_centroids grown to `vocab` tokens (seeded extra embedding rows, a new permutation): token ids above
    256, which BF16 cannot represent exactly. A sound model: transformers loads it."""
    def change(t: dict[str, torch.Tensor]) -> None:
        generator = torch.Generator().manual_seed(7)
        embed = t["model.embed_tokens.weight"]
        extra = torch.randn(vocab - embed.shape[0], embed.shape[1], generator=generator).to(embed.dtype)
        t["model.embed_tokens.weight"] = torch.cat([embed, extra])
        t["masked_embedding.token_ordering"] = torch.randperm(vocab, generator=generator)
    edit_tensors(folder, change)
    edit_config(folder, _set("text_config.vocab_size", vocab))


def every_tensor_fp32(folder: Path) -> None:
    """Every tensor cast to float32 with safetensors, token_ordering included (what a naive `.float()` script does)."""
    edit_tensors(folder, lambda t: t.update({k: v.float() for k, v in t.items()}))
