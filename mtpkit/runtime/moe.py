"""Gemma 4's mixture-of-experts block (26B-A4B): router and experts, run beside the dense MLP.

Checkpoints hold the experts either fused, as transformers writes them (`experts.gate_up_proj` [E, 2I, H],
`experts.down_proj` [E, H, I]), or unpacked per expert, as llm-compressor writes quantized ones and vLLM
reads them (`experts.<e>.{gate,up,down}_proj.<suffix>`, dense or FP8 / NVFP4); `fuse_expert_tensors`
turns the second form into the first.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch
from torch import nn

from mtpkit.formats.dequantize import UNSUPPORTED_SUFFIXES, WEIGHT_SCALE_SUFFIXES, WEIGHT_SUFFIXES, \
    dequantize_weight
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


# One unpacked expert projection's tensor, named as the model names its state (checkpoint prefix removed).
_PER_EXPERT = re.compile(r"^(?P<layer>layers\.\d+)\.experts\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)"
                         r"\.(?P<suffix>\w+)$")
# What dequantize_weight reads (and the suffixes it refuses by name); any other suffix is left in place,
# so the caller reports it as unexpected rather than it being dropped unread.
_READ = WEIGHT_SUFFIXES + WEIGHT_SCALE_SUFFIXES + tuple(UNSUPPORTED_SUFFIXES)


def fuse_expert_tensors(model: nn.Module, state: dict[str, torch.Tensor], prefix: str = "") -> list[str]:
    """Replace, in `state`, each MoE layer's unpacked per-expert tensors by the fused ones Experts holds.

    `state` is named as `model` names its state; `prefix` (the checkpoint's, e.g. `model.`) only labels
    errors. Each expert projection is dequantized with dequantize_weight (a dense one is just cast) to the
    dtype of the layer's Experts, then written into its place: gate into rows [0:I] and up into rows
    [I:2I] of `gate_up_proj[e]`, down into `down_proj[e]`. Returns the layers fused.

    The experts are held dense, in the model's dtype: Experts.forward runs every expert as one batched
    matmul over the fused tensors, and keeping FP8 / NVFP4 codes would mean dequantizing all E experts of a
    layer at each forward (or a grouped quantized GEMM, which this runtime does not have). Memory is
    therefore that of the dense experts, not of the checkpoint. ValueError naming the tensor for a missing
    expert projection, a wrong shape, or a layer that has both the fused and the unpacked form.
    """
    found: dict[str, dict[tuple[int, str], dict[str, str]]] = {}
    for name in state:
        match = _PER_EXPERT.match(name)
        if match and match["suffix"] in _READ:
            key = (int(match["expert"]), match["proj"])
            found.setdefault(match["layer"], {}).setdefault(key, {})[match["suffix"]] = name
    fused = []
    for layer, stored in found.items():
        try:
            experts = model.get_submodule(f"{layer}.experts")
        except AttributeError:
            continue  # no MoE there: the tensors stay and are reported as unexpected
        if not isinstance(experts, Experts):
            continue
        both = [f"{prefix}{layer}.experts.{p}" for p in ("gate_up_proj", "down_proj") if f"{layer}.experts.{p}" in state]
        if both:
            raise ValueError(f"{prefix}{layer}.experts holds both fused ({', '.join(both)}) and per-expert tensors")
        gate_up, down = _fused(experts, layer, {k: {s: state[n] for s, n in v.items()} for k, v in stored.items()},
                               prefix)
        for names in stored.values():
            for name in names.values():
                del state[name]
        state[f"{layer}.experts.gate_up_proj"], state[f"{layer}.experts.down_proj"] = gate_up, down
        fused.append(layer)
    return fused


def _fused(experts: Experts, layer: str, stored: Mapping[tuple[int, str], Mapping[str, torch.Tensor]],
           prefix: str) -> tuple[torch.Tensor, torch.Tensor]:
    num, (rows, hidden), inner = experts.num_experts, experts.gate_up_proj.shape[1:], experts.down_proj.shape[2]
    beyond = sorted(f"{prefix}{layer}.experts.{e}.{p}" for e, p in stored if e >= num)
    if beyond:
        raise ValueError(f"expert tensors beyond the config's {num} experts: {', '.join(beyond)}")
    names = [(e, p) for e in range(num) for p in ("gate_proj", "up_proj", "down_proj")]
    missing = [f"{prefix}{layer}.experts.{e}.{p}.weight" for e, p in names
               if not set(stored.get((e, p), ())) & set(WEIGHT_SUFFIXES)]
    if missing:
        raise ValueError(f"expert tensors missing: {', '.join(missing)} (or their weight_packed)")
    dtype = experts.gate_up_proj.dtype
    device = next(iter(next(iter(stored.values())).values())).device
    # Filled in place, one expert matrix at a time: a stack of per-expert copies would double the peak.
    gate_up = torch.empty(num, rows, hidden, dtype=dtype, device=device)
    down = torch.empty(num, hidden, inner, dtype=dtype, device=device)
    places = {"gate_proj": lambda e: gate_up[e, :rows // 2], "up_proj": lambda e: gate_up[e, rows // 2:],
              "down_proj": lambda e: down[e]}
    for e, proj in names:
        name = f"{prefix}{layer}.experts.{e}.{proj}"
        weight = dequantize_weight(stored[e, proj], dtype, name=name)
        place = places[proj](e)
        if weight.shape != place.shape:
            raise ValueError(f"{name} is {list(weight.shape)}, the config expects {list(place.shape)}")
        place.copy_(weight)
    return gate_up, down
