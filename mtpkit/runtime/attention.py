"""Gemma 4 self-attention over the static KV cache, and its masks."""

from __future__ import annotations

import torch
from torch import nn

from mtpkit.runtime.config import TextConfig
from mtpkit.runtime.kv_cache import KVCache
from mtpkit.runtime.layers import RMSNorm
from mtpkit.runtime.rope import apply_rotary


def attention_mask(positions: torch.Tensor, max_len: int, sliding_window: int | None = None,
                   key_positions: torch.Tensor | None = None) -> torch.Tensor:
    """Boolean `[B, 1, T, S]`, True where a query may attend a key.

    Keys are the cache slots, slot s holding position s (kv_cache.py), unless `key_positions` `[B, S]`
    says which position each key holds (a sliding ring; -1 for an empty or stale slot). Causality is
    `key <= position` per row, and the sliding window transformers' `kv_idx > q_idx - sliding_window`.
    Every query sees at least its own token, so no row is fully masked.
    """
    if key_positions is None:
        key_positions = torch.arange(max_len, device=positions.device)[None]
    keys = key_positions[:, None, None, :]
    query = positions[:, None, :, None]
    allowed = (keys <= query) & (keys >= 0)
    if sliding_window is not None:
        allowed = allowed & (query - keys < sliding_window)
    return allowed


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q `[B, heads, T, D]`, k and v `[B, kv_heads, S, D]`, mask `[B, 1, T, S]` -> `[B, heads, T, D]`.

    transformers' eager attention, op for op (scores in the model dtype, softmax in float32), so bf16
    results equal it bit for bit; SDPA reorders the reductions. No 1/sqrt(head_dim): Gemma 4's
    q_norm and k_norm take its place (transformers' scaling = 1.0).
    """
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3))
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


class Attention(nn.Module):
    def __init__(self, config: TextConfig, layer: int):
        super().__init__()
        spec = config.spec(layer)
        self.layer = layer
        self.head_dim = spec.head_dim
        hidden, heads, kv_heads = config.hidden_size, config.num_attention_heads, spec.num_key_value_heads
        bias = config.attention_bias
        self.q_proj = nn.Linear(hidden, heads * self.head_dim, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        # KV-shared layers have no K/V weights at all: they attend to their producer's cache.
        self.owns_kv = not config.is_kv_shared(layer)
        if self.owns_kv:
            self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=bias)
            # K=V layers (full attention of 26B / 31B) take values from k_proj's output, before k_norm.
            self.v_proj = None if spec.k_eq_v else nn.Linear(hidden, kv_heads * self.head_dim, bias=bias)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.v_norm = RMSNorm(self.head_dim, config.rms_norm_eps, with_scale=False)
        self.o_proj = nn.Linear(heads * self.head_dim, hidden, bias=bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        batch, length, _ = x.shape
        shape = (batch, length, -1, self.head_dim)
        q = apply_rotary(self.q_norm(self.q_proj(x).view(shape)), cos, sin).transpose(1, 2)
        if self.owns_kv:
            k = self.k_proj(x).view(shape)
            v = self.v_proj(x).view(shape) if self.v_proj is not None else k
            k = apply_rotary(self.k_norm(k), cos, sin).transpose(1, 2)
            v = self.v_norm(v).transpose(1, 2)
            k, v = cache.update(self.layer, positions, k, v)
        else:
            k, v = cache.read(self.layer)
        # The cache's storage dtype (float32, bf16, or FP8 read back dequantized as float32) to ours.
        out = attend(q, k.to(q.dtype), v.to(q.dtype), mask)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))
