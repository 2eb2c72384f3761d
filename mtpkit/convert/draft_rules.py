"""The rules that rewrite an assistant's config.json into canonical form, each application recorded.

Canonical: `model_type: gemma4_assistant`, architecture fields nested in `text_config` (as
transformers' Gemma4TextConfig defines them), assistant fields at the top, no quantization config,
the assistant invariants, head dims in the published flat dialect (or `per_layer_config` on request),
and every dimension agreeing with the tensors: where config and tensors disagree, the tensors decide.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any

from mtpkit.convert.draft_shapes import shape_facts
from mtpkit.convert.safetensors_file import TensorInfo
from mtpkit.errors import ConfigError
from mtpkit.formats import gemma4

ABSENT = "(absent)"  # `before`/`after` of a key that did not / does not exist
ASSISTANT_TOP_KEYS = ("backbone_hidden_size", "use_ordered_embeddings", "num_centroids", "centroid_intermediate_top_k",
                      "tie_word_embeddings")
QUANTIZATION_KEYS = ("quantization_config", "compression_config", "kv_cache_scheme")
DIALECT_KEYS = ("global_head_dim", "num_global_key_value_heads", "per_layer_config")
INVARIANTS = {"hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0, "enable_moe_block": False,
              "use_double_wide_mlp": False}
ARCHITECTURE = "Gemma4AssistantForCausalLM"


@dataclass(frozen=True)
class RuleApplication:
    rule: str
    path: str  # JSON path in config.json, or a file / tensor name
    before: Any
    after: Any
    reason: str

    def to_json(self) -> dict[str, Any]:
        return {"rule": self.rule, "path": self.path, "before": self.before, "after": self.after, "reason": self.reason}


def text_config_keys() -> frozenset[str]:
    """Keys that belong in text_config: the fields of transformers' Gemma4TextConfig, plus the head-dim dialects."""
    from transformers.models.gemma4.configuration_gemma4 import Gemma4TextConfig

    # tie_word_embeddings is a field of both configs; assistants keep it at the top level.
    return (frozenset(Gemma4TextConfig.__annotations__) | frozenset(DIALECT_KEYS)) - {"tie_word_embeddings"}


class _Rewrite:
    def __init__(self, config: dict):
        self.config = copy.deepcopy(config)
        self.applied: list[RuleApplication] = []

    def set(self, rule: str, path: str, value: Any, reason: str) -> None:
        """Set the value at a dotted path (one level of nesting at most), recording it if it changes."""
        holder, key = self._holder(path)
        before = holder.get(key, ABSENT)
        if before is not ABSENT and _same(before, value):
            return
        holder[key] = value
        self.applied.append(RuleApplication(rule, path, before, value, reason))

    def remove(self, rule: str, path: str, reason: str) -> None:
        holder, key = self._holder(path)
        if key in holder:
            self.applied.append(RuleApplication(rule, path, holder.pop(key), ABSENT, reason))

    def _holder(self, path: str) -> tuple[dict, str]:
        if path.startswith("text_config."):
            return self.config["text_config"], path.removeprefix("text_config.")
        return self.config, path


def _value_at(config: dict, path: str) -> Any:
    if path.startswith("text_config."):
        nested = config.get("text_config")
        return nested.get(path.removeprefix("text_config."), ABSENT) if isinstance(nested, dict) else ABSENT
    return config.get(path, ABSENT)


def _same(a: Any, b: Any) -> bool:
    return type(a) is type(b) and json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def canonical_config(config: dict, tensors: dict[str, TensorInfo], *, dialect: str = "flat", dtype: str = "bfloat16",
                     where: str = "config.json") -> tuple[dict, list[RuleApplication]]:
    """The canonical assistant config for these tensors, and the rules that got it there."""
    if gemma4.role_of(config, where) != "assistant" and config.get("model_type") != "gemma4_text":
        raise ConfigError(f"model_type {config.get('model_type')!r} is a target, not an assistant", where=where,
                          fix="pass the assistant (draft) checkpoint; `mtp-convert pair` takes the target")
    rw = _Rewrite(config)
    _model_type(rw)
    conflicts = _nest(rw, text_config_keys(), where)
    _quantization(rw)
    facts = shape_facts(rw.config["text_config"], tensors, where) if tensors else {}
    # The layer count first: reading per_layer_config needs layer_types and num_hidden_layers to agree.
    if "num_hidden_layers" in facts:
        _apply_fact(rw, "num_hidden_layers", facts["num_hidden_layers"], conflicts)
    _to_flat_dialect(rw, where)
    _dimensions(rw, facts, conflicts)
    _invariants(rw)
    rw.set("dtype", "dtype", dtype, "weights are written in this dtype")
    rw.remove("dtype", "torch_dtype", "the legacy spelling of `dtype`")
    if dialect == "per-layer":
        _to_per_layer_dialect(rw, where)
    # Keep only applications whose path really ends up changed: a detour (per-layer -> flat for the
    # shape rules -> per-layer again) is no change, so draft(draft(x)) records nothing new.
    net = [a for a in rw.applied if not _same(_value_at(config, a.path), _value_at(rw.config, a.path))]
    return rw.config, net


def _model_type(rw: _Rewrite) -> None:
    reason = "transformers and vLLM load assistants as gemma4_assistant (vLLM renames it to gemma4_mtp in memory only)"
    rw.set("model-type", "model_type", gemma4.ASSISTANT_MODEL_TYPE, reason)
    rw.set("model-type", "architectures", [ARCHITECTURE], reason)


def _nest(rw: _Rewrite, text_keys: frozenset[str], where: str) -> dict[str, tuple[Any, Any]]:
    """Move architecture fields into text_config; returns {key: (top value, nested value)} for disagreements."""
    config = rw.config
    if config.get("text_config") is None:
        before = config.get("text_config", ABSENT)
        config["text_config"] = {}
        rw.applied.append(RuleApplication("nest-text-config", "text_config", before, {},
                                          "architecture fields live in text_config"))
    gemma4.text_config_of(config, where)  # a text_config that is not an object is refused, not silently replaced
    nested = config["text_config"]
    conflicts = {}
    for key in sorted(k for k in config if k in text_keys):
        top = config.pop(key)
        if key not in nested:
            nested[key] = top
            rule, reason = "nest-text-config", f"moved to text_config.{key}: architecture fields live there"
        elif _same(nested[key], top):
            rule, reason = "remove-stale-top-level", f"a stale copy of text_config.{key}, which loaders read"
        else:
            conflicts[key] = (top, nested[key])
            rule, reason = "remove-stale-top-level", f"disagreed with text_config.{key} = {nested[key]!r}; resolved there"
        rw.applied.append(RuleApplication(rule, key, top, ABSENT, reason))
    rw.set("model-type", "text_config.model_type", "gemma4_text", "the nested decoder config is a gemma4_text config")
    if "tie_word_embeddings" in config and "tie_word_embeddings" not in nested:
        rw.set("nest-text-config", "text_config.tie_word_embeddings", config["tie_word_embeddings"],
               "a field of both configs; the published assistants carry it at both levels")
    for key in ASSISTANT_TOP_KEYS:
        if key in nested and key != "tie_word_embeddings":
            if key not in config:
                rw.set("unnest-assistant-field", key, nested[key], "assistant fields live at the top level")
            rw.remove("unnest-assistant-field", f"text_config.{key}", "assistant fields live at the top level")
    return conflicts


def _quantization(rw: _Rewrite) -> None:
    reason = ("quantization stays with the target: an inherited config makes vLLM build the draft quantized "
              "and fail on shapes")
    for key in QUANTIZATION_KEYS:
        rw.remove("strip-quantization", key, reason)
        rw.remove("strip-quantization", f"text_config.{key}", reason)


def _to_flat_dialect(rw: _Rewrite, where: str) -> None:
    text = rw.config["text_config"]
    if "per_layer_config" not in text:
        return
    geometry = gemma4.attention_geometry(text, prefix="text_config.", where=where)
    reason = "Google's published form; transformers >= 5.15 re-saves it as per_layer_config"
    if "full_attention" in geometry:
        full = geometry["full_attention"]
        rw.set("head-dim-dialect", "text_config.global_head_dim", full["head_dim"], reason)
        global_kv = full["num_key_value_heads"] if text.get("attention_k_eq_v") is True else None
        rw.set("head-dim-dialect", "text_config.num_global_key_value_heads", global_kv, reason)
    rw.remove("head-dim-dialect", "text_config.per_layer_config", reason)


def _to_per_layer_dialect(rw: _Rewrite, where: str) -> None:
    text = rw.config["text_config"]
    geometry = gemma4.attention_geometry(text, prefix="text_config.", where=where)
    layer_types = gemma4.layer_types_of(text, prefix="text_config.", where=where)
    overrides = {}
    for index, layer_type in enumerate(layer_types):
        override = {k: geometry[layer_type][k] for k in ("head_dim", "num_key_value_heads")
                    if geometry[layer_type][k] != text.get(k)}  # transformers writes only what differs
        if override:
            overrides[index] = override
    # transformers writes {} when every layer matches the global values.
    per_layer = {gemma4.per_layer_key(i, max(overrides)): o for i, o in overrides.items()} if overrides else {}
    reason = "--dialect per-layer: the form transformers >= 5.15 writes"
    rw.set("head-dim-dialect", "text_config.per_layer_config", per_layer, reason)
    rw.remove("head-dim-dialect", "text_config.global_head_dim", reason)
    rw.remove("head-dim-dialect", "text_config.num_global_key_value_heads", reason)


def _apply_fact(rw: _Rewrite, key: str, fact: tuple[Any, str], conflicts: dict[str, tuple[Any, Any]]) -> None:
    value, evidence = fact
    path = key if key in ASSISTANT_TOP_KEYS else f"text_config.{key}"
    if key in conflicts:
        top, nested = conflicts[key]
        reason = f"top level said {top!r}, text_config said {nested!r}; the tensors decide: {evidence}"
    else:
        reason = f"the tensors decide: {evidence}"
    rw.set("shape-decides", path, value, reason)


def _dimensions(rw: _Rewrite, facts: dict[str, tuple[Any, str]], conflicts: dict[str, tuple[Any, Any]]) -> None:
    """Where config and tensors disagree, the tensors decide. A top-level copy that disagreed with
    text_config and that no tensor decides was already dropped in favour of text_config (what loaders read)."""
    for key, fact in sorted(facts.items()):
        _apply_fact(rw, key, fact, conflicts)
    if "tie_word_embeddings" not in rw.config:
        rw.set("assistant-default", "tie_word_embeddings", True, "assistants tie lm_head to the embeddings")


def _invariants(rw: _Rewrite) -> None:
    text = rw.config["text_config"]
    layers = gemma4.get_int(text, "num_hidden_layers", prefix="text_config.", minimum=1, maximum=gemma4.MAX_LAYERS)
    rw.set("assistant-invariant", "text_config.num_kv_shared_layers", layers,
           "every assistant layer reads the target's K/V; it computes none of its own")
    for key, value in INVARIANTS.items():
        rw.set("assistant-invariant", f"text_config.{key}", value, "required of a Gemma 4 assistant")
