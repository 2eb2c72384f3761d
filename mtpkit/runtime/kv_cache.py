"""A static KV cache written at explicit per-sequence positions (gpt-fast style).

Slot s of a sequence holds the K/V of the token at position s. A forward writes its tokens at their
positions and attends every slot at or before each query's position (see attention.attention_mask),
so the cache keeps no lengths: the caller does. Rejecting draft tokens is just calling the next
forward at the rejected positions again; stale slots beyond a query's position are never read.

Padding: a batch row with fewer tokens than the others gives its padding tokens positions at or
after its real length (for example continuing its count). Their K/V land in slots the row's next
real tokens overwrite before any query can see them, and their outputs are ignored.
"""

from __future__ import annotations

import torch

from mtpkit.runtime.config import TextConfig


class KVCache:
    """Per cache-owning layer: keys and values `[batch, kv_heads, max_len, head_dim]`.

    KV-shared layers (index >= num_hidden_layers - num_kv_shared_layers) own nothing: they read the
    cache of the last non-shared layer of their attention type (`TextConfig.kv_source`), as
    transformers' `kv_sharing_modes` "reuse" layers do.

    Sliding-window layers keep the full max_len for now: the sliding mask hides slots outside the
    window, which keeps one write rule for every layer (a ring buffer would save memory).
    """

    def __init__(self, config: TextConfig, batch_size: int, max_len: int, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None):
        self.batch_size = batch_size
        self.max_len = max_len
        self.dtype = dtype
        self.source = config.kv_source
        self.k: list[torch.Tensor | None] = []
        self.v: list[torch.Tensor | None] = []
        for layer in range(config.num_hidden_layers):
            if config.is_kv_shared(layer):
                self.k.append(None)
                self.v.append(None)
                continue
            spec = config.spec(layer)
            shape = (batch_size, spec.num_key_value_heads, max_len, spec.head_dim)
            self.k.append(torch.zeros(shape, dtype=dtype, device=device))
            self.v.append(torch.zeros(shape, dtype=dtype, device=device))

    def update(self, layer: int, positions: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v `[B, kv_heads, T, head_dim]` at `positions` `[B, T]`; return the layer's whole cache.

        Positions must lie in [0, max_len) (not checked: that would need a device sync).
        """
        k_cache, v_cache = self.k[layer], self.v[layer]
        if k_cache is None:
            raise ValueError(f"layer {layer} is KV-shared: it reads layer {self.source[layer]}'s cache")
        if k.shape[0] != self.batch_size:
            raise ValueError(f"batch of {k.shape[0]} sequences, but the cache holds {self.batch_size}")
        # One index per (row, head, token, channel): scatter along the sequence dim, row by row.
        index = positions[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
        k_cache.scatter_(2, index, k.to(self.dtype))
        v_cache.scatter_(2, index, v.to(self.dtype))
        return k_cache, v_cache

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The cache `layer` attends to: its own, or its producer's for a KV-shared layer."""
        source = self.source[layer]
        return self.k[source], self.v[source]
