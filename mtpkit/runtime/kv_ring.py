"""Which position each slot of a sliding-window ring holds: bookkeeping shared by every ring layer.

A sliding layer attends only the last `sliding_window` positions, so its cache can be a ring of
R = window + slack slots, position p in slot p % R, instead of max_len slots. `slack` covers the tokens a
forward may write beyond the accepted ones (a verify chunk of k + 1), which a rejected draft leaves behind:
they must not evict a position the window still needs. Every ring layer is written with the same positions
in each forward, so one table serves them all.

In a forward, a ring layer attends [the ring as it was ; the forward's own new tokens], so a prefill longer
than the ring still sees every key its window needs; only the last R of its tokens are then kept. Slots
holding a position at or after the forward's first one are stale (a rejected draft, or a position being
rewritten now) and are masked. Tokens the caller marks invalid (padding) are not kept.
"""

from __future__ import annotations

import torch


class SlidingRing:
    def __init__(self, batch_size: int, size: int, device: torch.device):
        self.size = size
        # One spare slot (index `size`): where tokens that are not kept are written, never attended.
        self.slot_positions = torch.full((batch_size, size + 1), -1, dtype=torch.long, device=device)
        self.key_positions: torch.Tensor | None = None  # [B, size + T]: what this forward's ring layers attend
        self.index: torch.Tensor | None = None  # [B, T]: the slot each new token goes to

    def begin(self, positions: torch.Tensor, valid: torch.Tensor | None) -> None:
        """Plan a forward over `positions` `[B, T]` (consecutive per row); `valid` `[B, T]` marks real tokens."""
        size = self.size
        old = self.slot_positions[:, :size]
        old = torch.where(old < positions[:, :1], old, -1)
        self.key_positions = torch.cat([old, positions], dim=1)
        keep = torch.ones_like(positions, dtype=torch.bool) if valid is None else valid
        newest = torch.where(keep, positions, -1).amax(dim=1, keepdim=True)
        keep = keep & (positions > newest - size)  # only the last `size` of a long prefill fit
        self.index = torch.where(keep, positions % size, size)
        self.slot_positions = torch.cat([old, self.slot_positions[:, size:]], dim=1)
        self.slot_positions.scatter_(1, self.index, torch.where(keep, positions, -1))
        self.slot_positions[:, size] = -1

    def write_index(self, heads: int, head_dim: int) -> torch.Tensor:
        """The scatter index for a K or V tensor `[B, heads, T, head_dim]` of this forward."""
        return self.index[:, None, :, None].expand(-1, heads, -1, head_dim)
