"""The Gemma 4 text decoder (the target model), numerically equal to transformers' Gemma4TextModel.

Parameter names are the checkpoint's with the `model.` (or `model.language_model.`) prefix removed,
so weights.load_text_state_dict only strips a prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mtpkit.runtime.attention import Attention, attention_mask
from mtpkit.runtime.config import TextConfig
from mtpkit.runtime.kv_cache import KVCache
from mtpkit.runtime.layers import MLP, RMSNorm, activation
from mtpkit.runtime.moe import Experts, Router
from mtpkit.runtime.rope import RotaryEmbedding


@dataclass
class DecoderInputs:
    embeds: torch.Tensor  # [B, T, H], the first layer's input
    per_layer: torch.Tensor | None  # [B, T, num_layers, ple] (E2B / E4B)
    rope: dict[str, tuple[torch.Tensor, torch.Tensor]]  # attention type -> cos, sin
    masks: dict[str, torch.Tensor]  # attention type -> additive mask
    positions: torch.Tensor  # [B, T]


class ScaledEmbedding(nn.Embedding):
    """Embedding times sqrt(dim), the scale rounded to the weight's dtype first, as transformers does
    (in bf16 sqrt(1536) = 39.19 becomes 39.25)."""

    def __init__(self, num: int, dim: int, scale: float):
        super().__init__(num, dim)
        self.scale_value = scale  # kept to rebuild the buffer of a meta-device skeleton
        self.register_buffer("scale", torch.tensor(scale, dtype=torch.float32), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * self.scale.to(self.weight.dtype)


class DecoderLayer(nn.Module):
    def __init__(self, config: TextConfig, layer: int):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Attention(config, layer)
        self.mlp = MLP(hidden, config.mlp_intermediate_size(layer), config.hidden_activation)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps)
        # A checkpoint tensor (a buffer in transformers): the whole layer output is scaled by it.
        self.register_buffer("layer_scalar", torch.ones(1))
        self.enable_moe_block = config.enable_moe_block
        if self.enable_moe_block:
            self.router = Router(config)
            self.experts = Experts(config)
            self.post_feedforward_layernorm_1 = RMSNorm(hidden, eps)
            self.post_feedforward_layernorm_2 = RMSNorm(hidden, eps)
            self.pre_feedforward_layernorm_2 = RMSNorm(hidden, eps)
        self.per_layer_input = config.hidden_size_per_layer_input > 0
        if self.per_layer_input:
            self.act = activation(config.hidden_activation)
            self.per_layer_input_gate = nn.Linear(hidden, config.hidden_size_per_layer_input, bias=False)
            self.per_layer_projection = nn.Linear(config.hidden_size_per_layer_input, hidden, bias=False)
            self.post_per_layer_input_norm = RMSNorm(hidden, eps)

    def forward(self, x: torch.Tensor, per_layer_input: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), cos, sin, mask, positions, cache)
        x = x + self.post_attention_layernorm(attn)

        h = self.mlp(self.pre_feedforward_layernorm(x))
        if self.enable_moe_block:
            # The router and the experts read the residual stream before the dense MLP, not its output.
            flat = x.reshape(-1, x.shape[-1])
            weights, index = self.router(flat)
            moe = self.experts(self.pre_feedforward_layernorm_2(flat), weights, index).reshape(x.shape)
            h = self.post_feedforward_layernorm_1(h) + self.post_feedforward_layernorm_2(moe)
        x = x + self.post_feedforward_layernorm(h)

        if self.per_layer_input:
            gated = self.act(self.per_layer_input_gate(x)) * per_layer_input
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return x * self.layer_scalar


class Gemma4TextModel(nn.Module):
    def __init__(self, config: TextConfig):
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.embed_tokens = ScaledEmbedding(config.vocab_size, hidden, hidden**0.5)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        self.rotary = nn.ModuleDict({t: RotaryEmbedding(spec) for t, spec in config.attention.items()})
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(hidden, config.vocab_size, bias=False)
        ple = config.hidden_size_per_layer_input
        if ple:
            # Per-layer embeddings (E2B / E4B): one packed table, num_layers * ple wide.
            packed = config.num_hidden_layers * ple
            self.embed_tokens_per_layer = ScaledEmbedding(config.vocab_size_per_layer_input, packed, ple**0.5)
            self.per_layer_model_projection = nn.Linear(hidden, packed, bias=False)
            self.per_layer_projection_norm = RMSNorm(ple, config.rms_norm_eps)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Scaled token embeddings `[B, T, H]`, the decoder's input."""
        return self.embed_tokens(input_ids)

    def per_layer_inputs(self, input_ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """`[B, T, num_layers, ple]`: (token table + normed projection of the embedding) / sqrt(2)."""
        shape = (*input_ids.shape, self.config.num_hidden_layers, self.config.hidden_size_per_layer_input)
        tokens = self.embed_tokens_per_layer(input_ids).reshape(shape)
        projected = self.per_layer_model_projection(embeds) * self.config.hidden_size**-0.5
        projected = self.per_layer_projection_norm(projected.reshape(shape))
        return (projected + tokens) * 2.0**-0.5

    @classmethod
    def skeleton(cls, config: TextConfig) -> Gemma4TextModel:
        """The model with every parameter on the meta device (no memory), to be filled part by part with
        `load_state_dict(..., assign=True)`. The computed buffers (RoPE frequencies, embedding scales) are
        real: no checkpoint holds them."""
        with torch.device("meta"):
            model = cls(config)
        model.rotary = nn.ModuleDict({t: RotaryEmbedding(spec) for t, spec in config.attention.items()})
        for module in model.modules():
            if isinstance(module, ScaledEmbedding):
                module.scale = torch.tensor(module.scale_value, dtype=torch.float32)
        return model

    def prepare(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                valid: torch.Tensor | None = None) -> DecoderInputs:
        """Everything the decoder layers read besides the cache: embeddings, per-layer inputs, RoPE, masks.

        Starts the cache's forward (its sliding ring plans the writes; `valid` `[B, T]` marks the real tokens
        of a padded batch, so padding is not kept there).
        """
        cache.begin_forward(positions, valid)
        config = self.config
        media = None
        if config.media_token_ids:
            # A multimodal checkpoint run text-only: placeholder ids embed as padding, and the per-layer
            # inputs see the raw (unscaled) pad row there, as transformers' Gemma4Model does.
            media = torch.isin(input_ids, torch.tensor(config.media_token_ids, device=input_ids.device))
            input_ids = torch.where(media, config.pad_token_id or 0, input_ids)
        x = self.embed(input_ids)
        per_layer = None
        if config.hidden_size_per_layer_input:
            ple_embeds = x
            if media is not None:
                pad_row = self.embed_tokens.weight[config.pad_token_id or 0].to(x.dtype)
                ple_embeds = torch.where(media[..., None], pad_row, x)
            per_layer = self.per_layer_inputs(input_ids, ple_embeds)
        rope = {t: rotary(positions, x.dtype) for t, rotary in self.rotary.items()}
        masks = {t: attention_mask(positions, cache.max_len, config.sliding_window if t == "sliding_attention"
                                   else None, cache.key_positions(t)) for t in config.attention}
        return DecoderInputs(x, per_layer, rope, masks, positions)

    def run_layer(self, i: int, x: torch.Tensor, inputs: DecoderInputs, cache: KVCache) -> torch.Tensor:
        cos, sin = inputs.rope[self.config.layer_types[i]]
        per_layer = inputs.per_layer[:, :, i] if inputs.per_layer is not None else None
        return self.layers[i](x, per_layer, cos, sin, inputs.masks[self.config.layer_types[i]], inputs.positions,
                              cache)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                valid: torch.Tensor | None = None) -> torch.Tensor:
        """Final-norm hidden states `[B, T, H]` of tokens `[B, T]` at `positions` `[B, T]`.

        Writes each owning layer's K/V into `cache` at `positions` first (kv_cache.py: padding rule;
        `valid` marks the real tokens of a padded batch).
        """
        inputs = self.prepare(input_ids, positions, cache, valid)
        x = inputs.embeds
        for i in range(len(self.layers)):
            x = self.run_layer(i, x, inputs, cache)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """lm_head (tied to the embedding unless the config says otherwise), then final softcapping."""
        weight = self.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight
        logits = F.linear(hidden, weight)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
