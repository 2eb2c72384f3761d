"""`check`: does this assistant fit this target? Every known way a pair fails on a GPU, caught on files.

Each finding has an id, a severity and a message naming both files and the fix. Works on full
checkpoints and config-only folders (then the tensor checks are skipped).
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from pathlib import Path

from mtpkit.convert.checkpoint import Checkpoint
from mtpkit.convert.draft import HF_QUANT_CONFIG, is_assistant
from mtpkit.convert.draft_tensors import quantized_tensors
from mtpkit.convert.draft_rules import QUANTIZATION_KEYS
from mtpkit.convert.draft_shapes import layer_count
from mtpkit.convert.safetensors_file import load_tensor
from mtpkit.errors import ConfigError
from mtpkit.formats import gemma4
from mtpkit.formats.quantization import detect_quantization

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
_DRAFT_FIX = "run `mtp-convert draft` on the assistant"


@dataclass(frozen=True)
class Finding:
    id: str
    severity: str  # "error" or "warning"
    message: str

    def to_json(self) -> dict:
        return asdict(self)


class _Pair:
    """The two configs, with the paths every message names."""

    def __init__(self, target: Checkpoint, draft: Checkpoint):
        self.target, self.draft = target, draft
        self.t_where, self.d_where = str(target.folder / "config.json"), str(draft.folder / "config.json")
        if gemma4.role_of(target.config, self.t_where) != "target":
            raise ConfigError("is an assistant, not a target", where=self.t_where, fix="pass the target as --target")
        if not is_assistant(draft):
            raise ConfigError(f"model_type {draft.config.get('model_type')!r} is not an assistant", where=self.d_where,
                              fix="pass the assistant as --draft")
        self.t_text, self.t_prefix = gemma4.text_config_of(target.config, self.t_where)
        self.d_text, self.d_prefix = gemma4.text_config_of(draft.config, self.d_where)
        self.findings: list[Finding] = []

    def error(self, id_: str, message: str) -> None:
        self.findings.append(Finding(id_, "error", message))

    def warning(self, id_: str, message: str) -> None:
        self.findings.append(Finding(id_, "warning", message))


def check_pair(target: Checkpoint, draft: Checkpoint) -> list[Finding]:
    pair = _Pair(target, draft)
    for check in (_draft_form, _draft_quantization, _backbone_and_vocab, _kv_map, _shared_params, _centroids,
                  _draft_shapes, _tokenizer, _kv_scales):
        check(pair)
    return pair.findings


def _draft_form(p: _Pair) -> None:
    if p.draft.config.get("model_type") != gemma4.ASSISTANT_MODEL_TYPE:
        p.error("draft-model-type", f"{p.d_where}: model_type is {p.draft.config.get('model_type')!r}, which neither "
                f"transformers nor vLLM loads as an assistant; {_DRAFT_FIX}")
    if not p.d_prefix:
        p.error("draft-nesting", f"{p.d_where}: architecture fields are not nested in text_config, so loaders read "
                f"defaults instead; {_DRAFT_FIX}")
    layers, shared = p.d_text.get("num_hidden_layers"), p.d_text.get("num_kv_shared_layers")
    if shared != layers:
        p.error("draft-invariant", f"{p.d_where}: {p.d_prefix}num_kv_shared_layers is {shared!r}, must equal "
                f"num_hidden_layers ({layers}) for an assistant; {_DRAFT_FIX}")


def _draft_quantization(p: _Pair) -> None:
    leaked = [key for key in QUANTIZATION_KEYS if key in p.draft.config] + \
             [f"text_config.{key}" for key in QUANTIZATION_KEYS if p.d_prefix and key in p.d_text]
    if (p.draft.folder / HF_QUANT_CONFIG).is_file():
        leaked.append(HF_QUANT_CONFIG)
    if leaked:
        p.error("draft-quantization-config", f"{p.d_where}: the assistant carries {', '.join(leaked)} (copied from a "
                f"quantized target?); vLLM would build the draft quantized and fail on shapes; {_DRAFT_FIX}")
    quantized = quantized_tensors(p.draft.tensors)
    if quantized:
        p.error("draft-float-tensors", f"{quantized[0].file}: {quantized[0].name} is {quantized[0].dtype}; the "
                f"assistant must hold float tensors; start from the BF16 assistant checkpoint")


def _backbone_and_vocab(p: _Pair) -> None:
    target_hidden = p.t_text.get("hidden_size")
    backbone = p.draft.config.get("backbone_hidden_size")
    if backbone != target_hidden:
        p.error("backbone-hidden-size", f"{p.d_where}: backbone_hidden_size is {backbone!r} but the target's "
                f"{p.t_prefix}hidden_size in {p.t_where} is {target_hidden!r}: this assistant was trained for another "
                "target; pair it with its own target")
    if p.d_text.get("vocab_size") != p.t_text.get("vocab_size"):
        p.error("vocab-size", f"{p.d_where}: {p.d_prefix}vocab_size {p.d_text.get('vocab_size')!r} differs from "
                f"{p.t_prefix}vocab_size {p.t_text.get('vocab_size')!r} in {p.t_where}; the two cannot share tokens")


def _kv_map(p: _Pair) -> None:
    """The assistant reads the target's K/V at the producer layer of each attention type; the shapes must agree."""
    producers = gemma4.kv_producers(p.target.config, p.t_where)
    t_geometry = gemma4.attention_geometry(p.t_text, prefix=p.t_prefix, where=p.t_where)
    d_geometry = gemma4.attention_geometry(p.d_text, prefix=p.d_prefix, where=p.d_where)
    for layer_type, draft_geometry in d_geometry.items():
        if layer_type not in producers:
            p.error("kv-producer", f"{p.d_where}: the assistant has {layer_type} layers but the target ({p.t_where}) "
                    f"has no {layer_type} layer that computes K/V; pair it with its own target")
            continue
        target_geometry = t_geometry[layer_type]
        for key, check_id in (("head_dim", "kv-head-dim"), ("num_key_value_heads", "kv-heads"),
                              ("k_eq_v", "kv-k-eq-v")):
            if draft_geometry[key] != target_geometry[key]:
                p.error(check_id, f"{p.d_where}: {layer_type} {key} is {draft_geometry[key]!r} but the target's "
                        f"producer layer {producers[layer_type]} ({p.t_where}) has {target_geometry[key]!r}: the "
                        "assistant would read the wrong K/V (0 % acceptance); pair it with its own target")


def _shared_params(p: _Pair) -> None:
    for key in ("sliding_window", "rope_parameters", "rms_norm_eps"):
        if p.d_text.get(key) != p.t_text.get(key):
            p.error(key.replace("_", "-"), f"{p.d_where}: {p.d_prefix}{key} is {p.d_text.get(key)!r} but "
                    f"{p.t_where} says {p.t_text.get(key)!r}; the assistant attends over the target's cache with "
                    "the target's positions, so they must match: pair it with its own target")


def _centroids(p: _Pair) -> None:
    if p.draft.config.get("use_ordered_embeddings") is not True:
        return
    vocab, centroids = p.d_text.get("vocab_size"), p.draft.config.get("num_centroids")
    if not (isinstance(vocab, int) and isinstance(centroids, int) and centroids > 0 and vocab % centroids == 0):
        p.error("centroids-divide-vocab", f"{p.d_where}: vocab_size {vocab!r} is not a multiple of num_centroids "
                f"{centroids!r}; restore num_centroids from the original assistant")
        return
    info = p.draft.tensors.get("masked_embedding.token_ordering")
    if info is None:
        return
    import torch

    ordering = load_tensor(info).reshape(-1).long()
    if ordering.numel() != vocab or not torch.equal(torch.sort(ordering).values, torch.arange(vocab)):
        p.error("token-ordering", f"{info.file}: masked_embedding.token_ordering is not a permutation of "
                f"range({vocab}); the centroid path would score the wrong tokens: restore the original assistant")


def _draft_shapes(p: _Pair) -> None:
    if p.draft.config_only:
        return
    expected_shapes = expected_draft_shapes(p.draft.config, p.d_text, p.d_prefix, p.d_where,
                                            layer_count(p.draft.tensors))
    if "lm_head.weight" in p.draft.tensors:  # optional: tied to the embeddings when absent
        expected_shapes["lm_head.weight"] = expected_shapes["model.embed_tokens.weight"]
    for name, expected in sorted(expected_shapes.items()):
        info = p.draft.tensors.get(name)
        if info is None:
            p.error("draft-shapes", f"{p.draft.folder}: tensor {name} is missing (expected {list(expected)} from "
                    f"{p.d_where}); restore the original assistant")
        elif info.shape != expected:
            p.error("draft-shapes", f"{info.file}: {name} is {list(info.shape)} but {p.d_where} implies "
                    f"{list(expected)}; {_DRAFT_FIX} (the tensors decide)")


def expected_draft_shapes(config: dict, text: dict, prefix: str, where: str, tensor_layers: int) -> dict[str, tuple]:
    """The shape of every assistant tensor, as the config implies it."""
    hidden, vocab = text.get("hidden_size"), text.get("vocab_size")
    inter, heads = text.get("intermediate_size"), text.get("num_attention_heads")
    backbone = config.get("backbone_hidden_size")
    geometry = gemma4.attention_geometry(text, prefix=prefix, where=where)
    layer_types = gemma4.layer_types_of(text, prefix=prefix, where=where)
    shapes: dict[str, tuple] = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,),
                                "pre_projection.weight": (hidden, 2 * backbone if isinstance(backbone, int) else None),
                                "post_projection.weight": (backbone, hidden)}
    for i in range(max(len(layer_types), tensor_layers)):
        head_dim = geometry[layer_types[i]]["head_dim"] if i < len(layer_types) else None
        q_rows = heads * head_dim if isinstance(heads, int) and head_dim else None
        base = f"model.layers.{i}."
        shapes |= {base + "self_attn.q_proj.weight": (q_rows, hidden), base + "self_attn.o_proj.weight": (hidden, q_rows),
                   base + "self_attn.q_norm.weight": (head_dim,), base + "mlp.gate_proj.weight": (inter, hidden),
                   base + "mlp.up_proj.weight": (inter, hidden), base + "mlp.down_proj.weight": (hidden, inter)}
        for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            shapes[base + norm + ".weight"] = (hidden,)
    if config.get("use_ordered_embeddings") is True:
        shapes["masked_embedding.centroids.weight"] = (config.get("num_centroids"), hidden)
        shapes["masked_embedding.token_ordering"] = (vocab,)
    return shapes


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _tokenizer(p: _Pair) -> None:
    for name in TOKENIZER_FILES:
        t_file, d_file = p.target.folder / name, p.draft.folder / name
        if t_file.is_file() and d_file.is_file() and _sha256(t_file) != _sha256(d_file):
            p.error("tokenizer", f"{d_file} differs from {t_file}: the assistant must use the target's tokenizer; "
                    "copy the target's tokenizer files into the assistant, or pair the right checkpoints")


def _kv_scales(p: _Pair) -> None:
    quant = detect_quantization(p.target.config, p.target.read_json_file(HF_QUANT_CONFIG), p.t_where)
    if not quant or not quant.get("kv_cache") or p.target.config_only:
        return
    if not any(name.endswith(("k_scale", "v_scale")) for name in p.target.tensors):
        p.warning("kv-scales-missing", f"{p.t_where}: declares a {quant['kv_cache']} KV cache but {p.target.folder} "
                  "holds no k_scale/v_scale tensors; vLLM then uses a scale of 1.0 (accuracy loss); calibrate them "
                  "with `mtp-convert quantize`")
