"""A static KV cache written at explicit per-sequence positions (gpt-fast style).

Slot s of a sequence holds the K/V of the token at position s. A forward writes its tokens at their
positions and attends every slot at or before each query's position (see attention.attention_mask),
so the cache keeps no lengths: the caller does. Rejecting draft tokens is just calling the next
forward at the rejected positions again; stale slots beyond a query's position are never read.

Padding: a batch row with fewer tokens than the others gives its padding tokens positions at or
after its real length (for example continuing its count). Their K/V land in slots the row's next
real tokens overwrite before any query can see them, and their outputs are ignored.

FP8 (dtype=torch.float8_e4m3fn): vLLM's static per-tensor KV scales. Each owning layer has one
float32 scale for K and one for V; a write stores clamp(x / scale, -448, 448) as E4M3, a read returns
fp8.float() * scale. A scale is either given (a checkpoint's self_attn.k_scale / v_scale, which
compressed-tensors, llm-compressor and ModelOpt calibrate as amax / 448) or computed at the layer's
first write (the prefill) as that write's amax / 448, padding tokens included, and then frozen: later
tokens larger than the prefill's amax saturate at 448 * scale, as with vLLM's static scales.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from mtpkit.runtime.config import TextConfig
from mtpkit.runtime.kv_ring import SlidingRing

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
SLIDING = "sliding_attention"

Scales = Mapping[int, float | torch.Tensor] | Sequence[float | torch.Tensor | None]


class KVCache:
    """Per cache-owning layer: keys and values `[batch, kv_heads, max_len, head_dim]`.

    KV-shared layers (index >= num_hidden_layers - num_kv_shared_layers) own nothing: they read the
    cache of the last non-shared layer of their attention type (`TextConfig.kv_source`), as
    transformers' `kv_sharing_modes` "reuse" layers do.

    Sliding-window layers: with `sliding_slack` (the most tokens a forward writes past the accepted ones,
    k + 1 for speculative decoding), each keeps a ring of sliding_window + sliding_slack slots instead of
    max_len (kv_ring.py); without it they keep max_len slots and the sliding mask hides the rest. A ring
    layer's update returns [ring ; new tokens] and `key_positions(layer_type)` gives their positions for
    the masks; reading it (KV-shared layers, the assistant) gives the view of the last forward.

    `k_scales` / `v_scales` (FP8 only): per owning layer, a mapping layer -> scale or a list indexed
    by layer (None for a layer without one); a layer without a given scale computes it at its first
    write. `k_scale[layer]` / `v_scale[layer]` hold the scales in use (float32 scalars on the device).
    """

    def __init__(self, config: TextConfig, batch_size: int, max_len: int, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None, k_scales: Scales | None = None,
                 v_scales: Scales | None = None, lazy: bool = False, sliding_slack: int | None = None):
        """`lazy`: allocate no storage now; `allocate(layer)` and `release(layer)` manage it one layer at a time
        (layer-by-layer passes such as calibration, where only the layers in flight need a cache)."""
        self.batch_size = batch_size
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.max_len = max_len
        self.dtype = dtype
        self.fp8 = dtype == FP8
        if not self.fp8 and (k_scales is not None or v_scales is not None):
            raise ValueError(f"k_scales / v_scales need dtype={FP8}, not {dtype}")
        if dtype.is_floating_point and dtype.itemsize == 1 and not self.fp8:
            raise ValueError(f"unsupported 8-bit cache dtype {dtype}: only {FP8} is implemented")
        self.source = config.kv_source
        self.ring = None
        window = config.sliding_window
        if sliding_slack is not None and window and window + sliding_slack < max_len:
            self.ring = SlidingRing(batch_size, window + sliding_slack, self.device)
        self.ring_layers = set()
        self._fresh: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # ring layer -> its last forward's view
        self.k: list[torch.Tensor | None] = []
        self.v: list[torch.Tensor | None] = []
        for layer in range(config.num_hidden_layers):
            if config.is_kv_shared(layer):
                self.k.append(None)
                self.v.append(None)
                continue
            spec = config.spec(layer)
            slots = max_len
            if self.ring is not None and config.layer_types[layer] == SLIDING:
                slots = self.ring.size + 1
                self.ring_layers.add(layer)
            shape = (batch_size, spec.num_key_value_heads, slots, spec.head_dim)
            self.k.append(torch.zeros(shape, dtype=dtype, device="meta" if lazy else device))
            self.v.append(torch.zeros(shape, dtype=dtype, device="meta" if lazy else device))
        if self.fp8:
            given_k, given_v = self._given(k_scales, "k_scales", device), self._given(v_scales, "v_scales", device)
            # Placeholders of 1.0 until the first write: an unwritten cache is zeros whatever the scale.
            one = torch.ones((), dtype=torch.float32, device=device)
            self.k_scale = [given_k.get(i, one.clone()) for i in range(config.num_hidden_layers)]
            self.v_scale = [given_v.get(i, one.clone()) for i in range(config.num_hidden_layers)]
            # Host-side flags, so the forward decides "compute or not" without a device sync.
            self._pending = [(self.k[i] is not None and i not in given_k, self.k[i] is not None and i not in given_v)
                             for i in range(config.num_hidden_layers)]

    def begin_forward(self, positions: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Called once per forward, before any layer writes: plans the ring writes (no-op without a ring)."""
        if self.ring is not None:
            self.ring.begin(positions, valid)
            self._fresh.clear()

    def key_positions(self, layer_type: str) -> torch.Tensor | None:
        """`[B, S]` positions of what layers of this type attend, for a ring; None: slot s holds position s."""
        return self.ring.key_positions if self.ring is not None and layer_type == SLIDING else None

    def allocate(self, layer: int) -> None:
        """Give an owning layer of a lazy cache its (zeroed) storage; a no-op when it has it."""
        if self.k[layer] is not None and self.k[layer].is_meta:
            self.k[layer] = torch.zeros(self.k[layer].shape, dtype=self.dtype, device=self.device)
            self.v[layer] = torch.zeros(self.v[layer].shape, dtype=self.dtype, device=self.device)

    def release(self, layer: int) -> None:
        """Free an owning layer's storage once nothing will read it again (its scales stay)."""
        if self.k[layer] is not None:
            self.k[layer], self.v[layer] = self.k[layer].to("meta"), self.v[layer].to("meta")

    def _given(self, scales: Scales | None, name: str, device) -> dict[int, torch.Tensor]:
        """The given scales as {owning layer: float32 scalar}; checked here, once, outside the forward."""
        if scales is None:
            return {}
        items = scales.items() if isinstance(scales, Mapping) else enumerate(scales)
        out = {}
        for layer, scale in items:
            if scale is None:
                continue
            if not 0 <= layer < len(self.k):
                raise ValueError(f"{name}: no layer {layer} (the model has {len(self.k)})")
            if self.k[layer] is None:
                raise ValueError(f"{name}: layer {layer} is KV-shared and owns no cache to scale "
                                 f"(it reads layer {self.source[layer]}'s)")
            scale = torch.as_tensor(scale, dtype=torch.float32, device=device).detach().clone()
            if scale.numel() != 1:
                raise ValueError(f"{name}: layer {layer} has {scale.numel()} scales; only one per layer is supported")
            scale = scale.reshape(())
            if not bool(torch.isfinite(scale) & (scale > 0)):
                raise ValueError(f"{name}: layer {layer} scale {float(scale)} is not a positive finite number")
            out[layer] = scale
        return out

    def update(self, layer: int, positions: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v `[B, kv_heads, T, head_dim]` at `positions` `[B, T]`; return the layer's whole cache
        (dequantized to float32 for FP8, ready to attend).

        Positions must lie in [0, max_len) (not checked: that would need a device sync).
        """
        k_cache, v_cache = self.k[layer], self.v[layer]
        if k_cache is None:
            raise ValueError(f"layer {layer} is KV-shared: it reads layer {self.source[layer]}'s cache")
        if k.shape[0] != self.batch_size:
            raise ValueError(f"batch of {k.shape[0]} sequences, but the cache holds {self.batch_size}")
        if layer in self.ring_layers:
            return self._update_ring(layer, k, v)
        # One index per (row, head, token, channel): scatter along the sequence dim, row by row.
        index = positions[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
        if not self.fp8:
            k_cache.scatter_(2, index, k.to(self.dtype))
            v_cache.scatter_(2, index, v.to(self.dtype))
            return k_cache, v_cache
        self._fix_scales(layer, k, v)
        # CPU has no scatter for float8: scatter the same bytes as uint8 (CUDA takes the same path).
        k_cache.view(torch.uint8).scatter_(2, index, quantize(k, self.k_scale[layer]).view(torch.uint8))
        v_cache.view(torch.uint8).scatter_(2, index, quantize(v, self.v_scale[layer]).view(torch.uint8))
        return self.read(layer)

    def _fix_scales(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """At a layer's first write, compute the FP8 scales it was not given (then frozen)."""
        pending_k, pending_v = self._pending[layer]
        if pending_k:
            self.k_scale[layer].copy_(_amax_scale(k))
        if pending_v:
            self.v_scale[layer].copy_(_amax_scale(v))
        self._pending[layer] = (False, False)

    def _update_ring(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        size = self.ring.size
        old_k, old_v = self._stored(layer)
        if self.fp8:
            self._fix_scales(layer, k, v)
            k_stored, v_stored = quantize(k, self.k_scale[layer]), quantize(v, self.v_scale[layer])
            new_k, new_v = dequantize(k_stored, self.k_scale[layer]), dequantize(v_stored, self.v_scale[layer])
            k_stored, v_stored = k_stored.view(torch.uint8), v_stored.view(torch.uint8)
            k_cache, v_cache = self.k[layer].view(torch.uint8), self.v[layer].view(torch.uint8)
        else:
            new_k = k_stored = k.to(self.dtype)
            new_v = v_stored = v.to(self.dtype)
            k_cache, v_cache = self.k[layer], self.v[layer]
        # Attend the ring as it was and the new tokens (old first: the write below may evict some of them).
        view = torch.cat([old_k[:, :, :size], new_k], dim=2), torch.cat([old_v[:, :, :size], new_v], dim=2)
        index = self.ring.write_index(k.shape[1], k.shape[3])
        k_cache.scatter_(2, index, k_stored)
        v_cache.scatter_(2, index, v_stored)
        self._fresh[layer] = view
        return view

    def _stored(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.fp8:
            return self.k[layer], self.v[layer]
        return dequantize(self.k[layer], self.k_scale[layer]), dequantize(self.v[layer], self.v_scale[layer])

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The cache `layer` attends to: its own, or its producer's for a KV-shared layer (FP8: dequantized
        to float32 with the producer's scales; attention casts to its own dtype). For a ring layer, the view
        of the last forward (key_positions gives its positions), or the ring itself before any forward."""
        source = self.source[layer]
        if source in self.ring_layers:
            if source in self._fresh:
                return self._fresh[source]
            k, v = self._stored(source)
            return k[:, :, :self.ring.size], v[:, :, :self.ring.size]
        if not self.fp8:
            return self.k[source], self.v[source]
        return dequantize(self.k[source], self.k_scale[source]), dequantize(self.v[source], self.v_scale[source])

    def bytes_per_token(self) -> int:
        """Bytes of K/V storage one token of one sequence takes, over all owning layers (FP8 scales are
        per layer, not per token, so they do not count). Ring layers count too, as if unbounded: this is
        the per-token cost; `nbytes` is what the cache holds."""
        return sum(t.shape[1] * t.shape[3] * t.element_size() for t in (*self.k, *self.v) if t is not None)

    def nbytes(self) -> int:
        """Bytes of K/V storage the cache holds (a ring layer holds its window, not max_len)."""
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v) if t is not None)


def _amax_scale(x: torch.Tensor) -> torch.Tensor:
    # An all-zero write would give scale 0 and 0 / 0 = NaN; the smallest normal float32 keeps it finite.
    return (x.detach().abs().amax().float() / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale as E4M3, clamped first: an out-of-range cast would give NaN on some devices."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x.float() * scale
