"""Rotary position embeddings, per attention type, at arbitrary per-sequence positions.

Sliding layers use plain RoPE over the whole head. Full layers use transformers' "proportional"
RoPE: only the first `partial_rotary_factor` of the head's frequency pairs rotate, with exponents
over the *whole* head_dim, and the rest get frequency 0 (cos 1, sin 0: passed through unrotated).
"""

from __future__ import annotations

import torch
from torch import nn

from mtpkit.runtime.config import AttentionSpec


def inv_freq(spec: AttentionSpec) -> torch.Tensor:
    """[head_dim // 2] float32 frequencies, computed with transformers' exact ops (modeling_rope_utils)."""
    head_dim = spec.head_dim
    rotated = int(spec.partial_rotary_factor * head_dim // 2)
    exponents = torch.arange(0, 2 * rotated, 2, dtype=torch.int64).float() / head_dim
    freq = 1.0 / (spec.rope_theta ** exponents)
    freq = torch.cat([freq, torch.zeros(head_dim // 2 - rotated)])
    return freq / spec.rope_factor


class RotaryEmbedding(nn.Module):
    def __init__(self, spec: AttentionSpec):
        super().__init__()
        # Stored as the int32 bits of the float32 values: Module.to(dtype) casts floating buffers,
        # and bf16 frequencies would move every angle; transformers keeps them in float32.
        self.register_buffer("inv_freq_bits", inv_freq(spec).view(torch.int32), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin `[B, T, head_dim]` for positions `[B, T]`, in `dtype` (angles in float32)."""
        freqs = positions[..., None].float() * self.inv_freq_bits.view(torch.float32)
        angles = torch.cat([freqs, freqs], dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x `[B, T, heads, head_dim]` (heads before the transpose, as transformers applies it)."""
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    return x * cos + rotate_half(x) * sin
