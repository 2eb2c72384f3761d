"""Sampled generation with the target alone or with an MTP assistant drafting (speculative sampling).

The round structure, the state carried between rounds (last, hidden, pos) and the cache handling are
generate_greedy's (speculative.py); only drafting and acceptance differ. The drafter samples each
draft d_j from its distribution q_j; the target's verify forward gives p_j at the same positions,
both processed alike (sampling.probabilities). Draft j is accepted with probability
min(1, p_j(d_j) / q_j(d_j)); at the first rejection the round's own token is sampled from
normalize(max(p_j - q_j, 0)), and when all k are accepted from p_{k+1} (the bonus). Each emitted
token is then distributed exactly as the target's p (Leviathan et al. 2023, Chen et al. 2023).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mtpkit.runtime.config import TextConfig
from mtpkit.runtime.model import Gemma4TextModel
from mtpkit.runtime.sampling import check_sampling, probabilities, sample
from mtpkit.runtime.speculative import GenerationStats, RoundCallback, resolve_device, run_rounds


def _accepts(p_draft: torch.Tensor, q_draft: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Whether each draft is accepted: u < p/q, u ~ U[0, 1); multiplied out, as q > 0 for a drawn draft."""
    return u * q_draft < p_draft


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """normalize(max(p - q, 0)) `[B, V]`; q = 0 (no draft left: the bonus) gives p itself."""
    r = (p - q).clamp_(min=0.0)
    # Rounding can leave nothing after a rejection that p(d) < q(d) makes impossible in exact
    # arithmetic only when p ~= q; p is then the right distribution anyway.
    return torch.where(r.sum(-1, keepdim=True) > 0, r, p)


class SampledPolicy:
    """Speculative sampling: drafts sampled from q, accepted with min(1, p/q), the round's own token
    from the residual (or p, after k accepted drafts)."""

    def __init__(self, assistant, dist, generator: torch.Generator):
        self.assistant, self.dist, self.generator = assistant, dist, generator

    def first(self, logits: torch.Tensor) -> torch.Tensor:
        return sample(self.dist(logits), self.generator)

    def draft(self, target, last, hidden, pos, cache, target_config, k):
        drafts, q, token, h = [], [], last, hidden
        for _ in range(k):
            h, normed = self.assistant(target.embed(token[:, None])[:, 0], h, pos, cache, target_config)
            q.append(self.dist(self.assistant.logits(normed, fill=float("-inf"))))
            token = sample(q[-1], self.generator)
            drafts.append(token)
        return drafts, q

    def accept(self, target, chunk, verified, q):
        batch, k = chunk.shape[0], chunk.shape[1] - 1
        rows = torch.arange(batch, device=chunk.device)
        p = self.dist(target.logits(verified))  # p[:, j]: the target's distribution for pos + j + 1
        # q padded with a zero row: after k accepted drafts the residual at index k is p's bonus.
        q = torch.stack([*q, torch.zeros_like(p[:, 0])], dim=1)
        if k:
            d = chunk[:, 1:, None]
            ok = _accepts(p[:, :k].gather(-1, d)[..., 0], q[:, :k].gather(-1, d)[..., 0],
                          torch.rand(batch, k, device=chunk.device, generator=self.generator))
            accepted = ok.long().cumprod(dim=1).sum(dim=1)  # [B]: drafts before the first rejection
        else:
            accepted = torch.zeros(batch, dtype=torch.long, device=chunk.device)
        own = sample(_residual(p[rows, accepted], q[rows, accepted]), self.generator)
        # tokens[:, :accepted + 1]: the accepted drafts, then the round's own token.
        tokens = torch.cat([chunk[:, 1:], own[:, None]], dim=1).scatter_(1, accepted[:, None], own[:, None])
        return tokens, accepted


@torch.inference_mode()
def generate_sampled(target: Gemma4TextModel, target_config: TextConfig, prompts: list[list[int]], *,
                     max_new_tokens: int, assistant=None, num_speculative_tokens: int = 4,
                     temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                     eos_token_ids: Sequence[int] = (), stop_token_ids: Sequence[int] = (),
                     cache_dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                     cache_scales: dict | None = None,
                     on_round: RoundCallback | None = None) -> tuple[list[list[int]], GenerationStats]:
    """Sampled continuations of `prompts` (new tokens only, each ending at its first stop token if any).

    `assistant`: a Gemma4Assistant (called for (draft_hidden, normed), then logits(normed, fill=-inf)
    so that tokens outside its top centroids have q = 0); None samples from the target alone. The
    same `seed` gives the same outputs (on the same device and batch); None draws a fresh seed.
    temperature 0 gives generate_greedy's outputs. Stats as generate_greedy's.
    """
    check_sampling(temperature, top_k, top_p)
    device = resolve_device(target, device)
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    policy = SampledPolicy(assistant, lambda logits: probabilities(logits, temperature, top_k, top_p), generator)
    return run_rounds(target, target_config, prompts, policy, max_new_tokens=max_new_tokens,
                      k=num_speculative_tokens if assistant is not None else 0, eos_token_ids=eos_token_ids,
                      stop_token_ids=stop_token_ids, cache_dtype=cache_dtype, device=device,
                      cache_scales=cache_scales, on_round=on_round)
