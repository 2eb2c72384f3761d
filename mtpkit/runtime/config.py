"""TextConfig: everything the Gemma 4 text decoder's forward needs, read once from config.json.

Missing keys take transformers' `Gemma4TextConfig` defaults, so a config that transformers accepts
builds the same model here. Head geometry and the KV-sharing map come from `mtpkit.formats.gemma4`,
the same readers `inspect` and `check` use, so the runtime cannot disagree with them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mtpkit.errors import ConfigError
from mtpkit.formats.gemma4 import (
    attention_geometry,
    get_int,
    kv_producers,
    layer_types_of,
    text_config_of,
)

# The activations Gemma 4 checkpoints use (transformers' ACT2FN names); layers.activation maps them.
ACTIVATIONS = ("gelu_pytorch_tanh", "gelu", "silu")
ROPE_TYPES = ("default", "proportional")

# transformers' Gemma4TextConfig.__post_init__ default when rope_parameters is absent.
_DEFAULT_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}


@dataclass(frozen=True)
class AttentionSpec:
    """Geometry and RoPE of one attention type (Gemma 4 has one of each per type)."""

    head_dim: int
    num_key_value_heads: int
    k_eq_v: bool  # values come from k_proj (no v_proj); only full layers of 26B / 31B
    rope_type: str
    rope_theta: float
    # transformers' "default" RoPE ignores both, so they are 1.0 there; "proportional" rotates only
    # the first partial_rotary_factor of the head and divides the frequencies by factor.
    partial_rotary_factor: float = 1.0
    rope_factor: float = 1.0


@dataclass(frozen=True)
class TextConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    num_attention_heads: int
    attention: dict[str, AttentionSpec]  # by attention type
    sliding_window: int
    max_position_embeddings: int
    rms_norm_eps: float
    final_logit_softcapping: float | None
    hidden_activation: str
    hidden_size_per_layer_input: int  # 0: no per-layer inputs (PLE)
    vocab_size_per_layer_input: int
    num_kv_shared_layers: int
    kv_source: tuple[int, ...]  # for each layer, the layer whose KV cache it reads (itself if it owns one)
    use_double_wide_mlp: bool
    enable_moe_block: bool
    num_experts: int | None
    top_k_experts: int | None
    moe_intermediate_size: int | None
    attention_bias: bool
    tie_word_embeddings: bool
    pad_token_id: int | None
    bos_token_id: int | None
    eos_token_id: tuple[int, ...]
    # Image / video / audio placeholder ids of a multimodal wrapper: text-only, they embed as padding.
    media_token_ids: tuple[int, ...] = ()

    @property
    def first_kv_shared_layer(self) -> int:
        return self.num_hidden_layers - self.num_kv_shared_layers

    def is_kv_shared(self, layer: int) -> bool:
        return layer >= self.first_kv_shared_layer

    def spec(self, layer: int) -> AttentionSpec:
        return self.attention[self.layer_types[layer]]

    def mlp_intermediate_size(self, layer: int) -> int:
        # transformers' Gemma4TextMLP: only KV-shared ("reuse") layers are double wide.
        wide = self.use_double_wide_mlp and self.is_kv_shared(layer)
        return self.intermediate_size * (2 if wide else 1)

    @classmethod
    def from_dict(cls, config: dict, where: str = "config.json") -> TextConfig:
        """From a target's config.json dict: `gemma4_text` (flat) or the `gemma4` wrapper (`text_config`)."""
        text, prefix = text_config_of(config, where)
        kw = {"prefix": prefix, "where": where}

        def flag(key: str, default: bool) -> bool:
            value = text.get(key, default)
            value = default if value is None else value
            if not isinstance(value, bool):
                raise ConfigError(f"{prefix}{key} is {value!r}, expected true or false", where=where,
                                  fix="restore the value from the original config")
            return value

        def number(key: str, default: float | None) -> float | None:
            value = text.get(key, default)
            if value is None:
                return None
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ConfigError(f"{prefix}{key} is {value!r}, expected a positive number", where=where,
                                  fix="restore the value from the original config")
            return float(value)

        layer_types = layer_types_of(text, **kw)
        if layer_types[-1] != "full_attention":
            # transformers silently rewrites the last layer to full attention; we refuse rather than
            # run a model whose layer types (and KV-producer map) differ from its config.
            raise ConfigError(f"{prefix}layer_types ends in {layer_types[-1]!r}; Gemma 4 ends in full_attention",
                              where=where, fix="restore layer_types from the original config")
        if text.get("use_bidirectional_attention") == "all":
            raise ConfigError(f"{prefix}use_bidirectional_attention is 'all': not a causal decoder", where=where,
                              fix="the runtime runs causal Gemma 4 targets only")
        activation = text.get("hidden_activation", "gelu_pytorch_tanh")
        if activation not in ACTIVATIONS:
            raise ConfigError(f"{prefix}hidden_activation is {activation!r}, expected one of {', '.join(ACTIVATIONS)}",
                              where=where, fix="restore hidden_activation from the original config")

        rope = text.get("rope_parameters") or _DEFAULT_ROPE
        attention = {
            layer_type: AttentionSpec(**geometry, **_rope_of(rope, layer_type, prefix, where))
            for layer_type, geometry in attention_geometry(text, **kw).items()
        }
        num_layers = len(layer_types)
        shared = get_int(text, "num_kv_shared_layers", default=0, **kw)
        producers = kv_producers(config, where)  # raises when a shared type has no producer
        kv_source = tuple(i if i < num_layers - shared else producers[t] for i, t in enumerate(layer_types))

        moe = flag("enable_moe_block", False)
        moe_int = {"default": None} if not moe else {"minimum": 1}
        eos = text.get("eos_token_id", 1)
        eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
        # The wrapper's own tie_word_embeddings decides for Gemma4ForConditionalGeneration.
        tie = config.get("tie_word_embeddings", text.get("tie_word_embeddings", True))

        return cls(
            vocab_size=get_int(text, "vocab_size", default=262_144, minimum=1, **kw),
            hidden_size=get_int(text, "hidden_size", default=2304, minimum=1, **kw),
            intermediate_size=get_int(text, "intermediate_size", default=9216, minimum=1, **kw),
            num_hidden_layers=num_layers,
            layer_types=tuple(layer_types),
            num_attention_heads=get_int(text, "num_attention_heads", default=8, minimum=1, **kw),
            attention=attention,
            sliding_window=get_int(text, "sliding_window", default=512, minimum=1, **kw),
            max_position_embeddings=get_int(text, "max_position_embeddings", default=131_072, minimum=1, **kw),
            rms_norm_eps=number("rms_norm_eps", 1e-6),
            final_logit_softcapping=number("final_logit_softcapping", None),
            hidden_activation=activation,
            hidden_size_per_layer_input=get_int(text, "hidden_size_per_layer_input", default=256, **kw),
            vocab_size_per_layer_input=get_int(text, "vocab_size_per_layer_input", default=262_144, **kw),
            num_kv_shared_layers=shared,
            kv_source=kv_source,
            use_double_wide_mlp=flag("use_double_wide_mlp", False),
            enable_moe_block=moe,
            num_experts=get_int(text, "num_experts", **moe_int, **kw),
            top_k_experts=get_int(text, "top_k_experts", **moe_int, **kw),
            moe_intermediate_size=get_int(text, "moe_intermediate_size", **moe_int, **kw),
            attention_bias=flag("attention_bias", False),
            tie_word_embeddings=bool(tie),
            pad_token_id=text.get("pad_token_id", 0),
            bos_token_id=text.get("bos_token_id", 2),
            eos_token_id=eos,
            media_token_ids=tuple(config[k] for k in _MEDIA_TOKEN_KEYS if type(config.get(k)) is int)
            if prefix else (),
        )


# Gemma4Config's placeholder ids; transformers embeds them as pad_token_id in Gemma4Model.forward.
_MEDIA_TOKEN_KEYS = ("image_token_id", "video_token_id", "audio_token_id")


def _rope_of(rope: Any, layer_type: str, prefix: str, where: str) -> dict[str, Any]:
    """The AttentionSpec RoPE fields of one attention type, from rope_parameters[layer_type]."""
    key = f"{prefix}rope_parameters.{layer_type}"
    params = rope.get(layer_type) if isinstance(rope, dict) else None
    if not isinstance(params, dict):
        raise ConfigError(f"{key} is missing", where=where, fix="restore rope_parameters from the original config")
    rope_type = params.get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        raise ConfigError(f"{key}.rope_type is {rope_type!r}; the runtime supports {', '.join(ROPE_TYPES)}",
                          where=where, fix="Gemma 4 uses default RoPE on sliding and proportional on full layers")
    values = {}
    fields = {"rope_theta": ("rope_theta", None), "partial_rotary_factor": ("partial_rotary_factor", 1.0),
              "factor": ("rope_factor", 1.0)}
    for name, (field, default) in fields.items():
        value = params.get(name, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ConfigError(f"{key}.{name} is {value!r}, expected a positive number", where=where,
                              fix="restore rope_parameters from the original config")
        values[field] = float(value)
    if rope_type == "default":  # transformers' default RoPE reads only rope_theta
        values.update(partial_rotary_factor=1.0, rope_factor=1.0)
    return {"rope_type": rope_type, **values}

