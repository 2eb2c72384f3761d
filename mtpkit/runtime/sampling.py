"""Token distributions from logits (temperature, top-k, top-p) and seeded sampling from them.

Speculative sampling compares the target's and the drafter's distributions token by token, so both
must go through exactly this processing: `probabilities` returns the full-vocabulary distribution,
not a sampled id, and sampling is a separate step.
"""

from __future__ import annotations

import torch


def check_sampling(temperature: float, top_k: int, top_p: float) -> None:
    if temperature < 0 or top_k < 0 or not 0.0 < top_p <= 1.0:
        raise ValueError(f"need temperature >= 0, top_k >= 0 and 0 < top_p <= 1; got temperature {temperature}, "
                         f"top_k {top_k}, top_p {top_p}")


def probabilities(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0,
                  top_p: float = 1.0) -> torch.Tensor:
    """float32 probabilities `[..., V]` of `logits` `[..., V]`.

    temperature 0 is greedy: a one-hot of the argmax (top_k and top_p then change nothing). Otherwise
    softmax(logits / temperature) restricted to the top_k largest logits (0: all; ties broken as
    torch.topk breaks them, so exactly top_k stay), then to the smallest set of the most probable
    tokens whose probability sums to >= top_p, renormalised after each cut. Logits of -inf (a
    masked vocabulary) get probability 0.
    """
    check_sampling(temperature, top_k, top_p)
    logits = logits.float()
    if temperature == 0:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        keep = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, logits.topk(top_k, dim=-1).indices, True)
        logits = logits.masked_fill(~keep, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # A token stays while the tokens more probable than it sum to less than top_p: the minimal
        # prefix reaching top_p (the most probable token always stays).
        before = sorted_probs.cumsum(-1) - sorted_probs
        keep = torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, order, before < top_p)
        probs = probs.masked_fill(~keep, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token id per row of `probs` `[..., V]` (need not sum to 1; no all-zero row): `[...]`."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])
