"""Gemma 4's mixture-of-experts block (26B-A4B): router and experts, run beside the dense MLP."""

from __future__ import annotations

import torch
from torch import nn

from mtpkit.runtime.config import TextConfig
from mtpkit.runtime.layers import RMSNorm, activation


class Router(nn.Module):
    def __init__(self, config: TextConfig):
        super().__init__()
        hidden = config.hidden_size
        self.top_k = config.top_k_experts
        self.root_size = hidden**-0.5
        self.norm = RMSNorm(hidden, config.rms_norm_eps, with_scale=False)
        self.proj = nn.Linear(hidden, config.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(hidden))
        self.per_expert_scale = nn.Parameter(torch.ones(config.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k expert weights (float32, renormalised, times per_expert_scale) and indices, `[N, k]`."""
        scores = self.proj(self.norm(x) * self.scale * self.root_size)  # transformers' order of products
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
        weights, index = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[index], index


class Experts(nn.Module):
    """Expert weights as transformers stores them: gate_up_proj `[E, 2I, H]`, down_proj `[E, H, I]`."""

    def __init__(self, config: TextConfig):
        super().__init__()
        experts, hidden, inner = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.num_experts = experts
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * inner, hidden))
        self.down_proj = nn.Parameter(torch.empty(experts, hidden, inner))
        self.act = activation(config.hidden_activation)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """x `[N, H]`; weights, index `[N, k]` from the Router."""
        # Every expert runs on every token and each token then picks its k outputs: static shapes, no
        # host sync and no per-expert Python loop (CUDA graphs, torch.compile). It costs
        # num_experts / top_k times the FLOPs, which the small batches of decode and draft verification
        # hide behind reading the weights; a grouped GEMM can replace it for long prefills.
        gate, up = torch.matmul(x, self.gate_up_proj.transpose(1, 2)).chunk(2, dim=-1)  # [E, N, I] each
        out = torch.matmul(self.act(gate) * up, self.down_proj.transpose(1, 2))  # [E, N, H]
        # Sum as transformers' loop does, to round the same in bf16: in ascending expert order, each
        # output scaled by its float32 weight, cast to x's dtype, then added.
        index, order = index.sort(dim=-1)
        weights = weights.gather(1, order)
        tokens = torch.arange(x.shape[0], device=x.device)
        total = torch.zeros_like(x)
        for j in range(index.shape[1]):
            total = total + (out[index[:, j], tokens] * weights[:, j, None]).to(x.dtype)
        return total
