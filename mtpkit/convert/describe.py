"""A description of a checkpoint: what it is (family, role, quantization) and what it holds.

Built from the configs and the safetensors headers only; no tensor data is read.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any

from mtpkit.convert.checkpoint import Checkpoint
from mtpkit.convert.safetensors_file import TensorInfo
from mtpkit.formats import gemma4
from mtpkit.formats.quantization import detect_quantization

# Tensors that hold quantization scales, not model parameters.
_AUXILIARY_SUFFIXES = ("weight_scale", "weight_scale_2", "weight_global_scale", "weight_zero_point", "weight_shape",
                       "input_scale", "input_global_scale", "output_scale", "k_scale", "v_scale")
# Gemma 4 buffers saved beside the parameters; transformers' num_parameters() does not count them.
_BUFFER_SUFFIXES = ("layer_scalar", "token_ordering")
_ARCH_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim", "global_head_dim", "num_global_key_value_heads", "num_kv_shared_layers", "vocab_size",
              "sliding_window", "attention_k_eq_v", "enable_moe_block", "num_experts", "top_k_experts",
              "hidden_size_per_layer_input", "use_double_wide_mlp", "final_logit_softcapping")


@dataclass
class Description:
    path: str
    family: str
    role: str  # "target" or "assistant"
    model_type: str
    architectures: list[str]
    quantization: dict | None
    config_only: bool
    num_parameters: int | None
    num_tensors: int
    total_bytes: int
    shards: int
    dtypes: dict[str, dict[str, int]]  # dtype -> {"tensors": n, "bytes": b}
    architecture: dict[str, Any]
    config_form: dict[str, str]  # how the config is written: text_config nesting and head-dim dialect
    layer_types: dict[str, int]  # attention type -> layer count
    kv_producers: dict[str, int] | None  # targets only
    assistant: dict[str, Any] | None  # assistants only
    warnings: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _parameters_in(info: TensorInfo, tensors: dict[str, TensorInfo]) -> int:
    """Logical parameters a tensor stands for: packed FP4 bytes hold two, scales and buffers none."""
    last = info.name.rsplit(".", 1)[-1]
    if last in _AUXILIARY_SUFFIXES or last in _BUFFER_SUFFIXES:
        return 0
    if last == "weight_packed" and info.dtype == "U8":  # compressed-tensors nvfp4-pack-quantized
        return info.numel * 2
    module = info.name[: -len(last) - 1] if "." in info.name else ""
    if last == "weight" and info.dtype == "U8" and f"{module}.weight_scale_2" in tensors:  # ModelOpt NVFP4
        return info.numel * 2
    return info.numel


def _config_form(prefix: str, text: dict) -> dict[str, str]:
    # Google's files write global_head_dim / num_global_key_value_heads; transformers >= 5.15 re-saves
    # them as per_layer_config. Loaders differ in which they read, so say which one this is.
    if "per_layer_config" in text:
        head_dims = "per_layer_config"
    elif "global_head_dim" in text:
        head_dims = "global_head_dim"
    else:
        head_dims = "default"
    return {"text_config": "nested" if prefix else "flat", "head_dims": head_dims}


def describe(checkpoint: Checkpoint, *, path: str | None = None) -> Description:
    where = str(checkpoint.folder / "config.json")
    config = checkpoint.config
    role = gemma4.role_of(config, where)
    text, prefix = gemma4.text_config_of(config, where)
    layer_types = gemma4.layer_types_of(text, prefix=prefix, where=where)
    hf_quant = checkpoint.read_json_file("hf_quant_config.json")
    warnings: list[str] = []

    dtypes: dict[str, dict[str, int]] = defaultdict(lambda: {"tensors": 0, "bytes": 0})
    for info in checkpoint.tensors.values():
        dtypes[info.dtype]["tensors"] += 1
        dtypes[info.dtype]["bytes"] += info.nbytes
    num_parameters = None
    if not checkpoint.config_only:
        num_parameters = sum(_parameters_in(t, checkpoint.tensors) for t in checkpoint.tensors.values())

    kv = assistant = None
    if role == "target":
        kv = gemma4.kv_producers(config, where)
    else:
        assistant = gemma4.assistant_fields(config)
        if config.get("model_type") != gemma4.ASSISTANT_MODEL_TYPE:
            warnings.append(f"model_type {config.get('model_type')!r} loads in neither transformers nor vLLM; "
                            "`mtp-convert draft` rewrites it as gemma4_assistant")
        if prefix == "":
            warnings.append("architecture fields are not nested in text_config; `mtp-convert draft` nests them")
    quantization = detect_quantization(config, hf_quant, where)
    if role == "assistant" and quantization is not None:
        warnings.append("the assistant carries a quantization config (leaked from its target?); vLLM would apply "
                        "it to the draft; `mtp-convert draft` removes it")

    return Description(
        path=path or str(checkpoint.folder),
        family=gemma4.FAMILY,
        role=role,
        model_type=str(config.get("model_type")),
        architectures=list(config.get("architectures") or []),
        quantization=quantization,
        config_only=checkpoint.config_only,
        num_parameters=num_parameters,
        num_tensors=len(checkpoint.tensors),
        total_bytes=checkpoint.total_bytes,
        shards=len(checkpoint.shards),
        dtypes=dict(sorted(dtypes.items())),
        architecture={key: text.get(key) for key in _ARCH_KEYS if key in text},
        config_form=_config_form(prefix, text),
        layer_types={t: layer_types.count(t) for t in gemma4.ATTENTION_TYPES if t in layer_types},
        kv_producers=kv,
        assistant=assistant,
        warnings=warnings,
    )
