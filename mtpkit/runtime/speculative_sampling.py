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
from mtpkit.runtime.kv_cache import KVCache
from mtpkit.runtime.model import Gemma4TextModel
from mtpkit.runtime.sampling import check_sampling, probabilities, sample
from mtpkit.runtime.speculative import GenerationStats, _clock


def _accepts(p_draft: torch.Tensor, q_draft: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Whether each draft is accepted: u < p/q, u ~ U[0, 1); multiplied out, as q > 0 for a drawn draft."""
    return u * q_draft < p_draft


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """normalize(max(p - q, 0)) `[B, V]`; q = 0 (no draft left: the bonus) gives p itself."""
    r = (p - q).clamp_(min=0.0)
    # Rounding can leave nothing after a rejection that p(d) < q(d) makes impossible in exact
    # arithmetic only when p ~= q; p is then the right distribution anyway.
    return torch.where(r.sum(-1, keepdim=True) > 0, r, p)


@torch.inference_mode()
def generate_sampled(target: Gemma4TextModel, target_config: TextConfig, prompts: list[list[int]], *,
                     max_new_tokens: int, assistant=None, num_speculative_tokens: int = 4,
                     temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                     eos_token_ids: Sequence[int] = (), stop_token_ids: Sequence[int] = (),
                     cache_dtype: torch.dtype = torch.float32,
                     device: torch.device | str | None = None) -> tuple[list[list[int]], GenerationStats]:
    """Sampled continuations of `prompts` (new tokens only, each ending at its first stop token if any).

    `assistant`: a Gemma4Assistant (called for (draft_hidden, normed), then logits(normed, fill=-inf)
    so that tokens outside its top centroids have q = 0); None samples from the target alone. The
    same `seed` gives the same outputs (on the same device and batch); None draws a fresh seed.
    temperature 0 gives generate_greedy's outputs. Stats as generate_greedy's.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    check_sampling(temperature, top_k, top_p)
    k = num_speculative_tokens if assistant is not None else 0
    if k < 0 or max_new_tokens < 0:
        raise ValueError("num_speculative_tokens and max_new_tokens must be >= 0")
    stats = GenerationStats(num_speculative_tokens=k, accepted_per_position=[0] * k)
    batch = len(prompts)
    if max_new_tokens == 0:
        stats.accepted_lengths = [[] for _ in prompts]
        return [[] for _ in prompts], stats
    device = torch.device(device) if device is not None else target.embed_tokens.weight.device
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)

    def dist(logits: torch.Tensor) -> torch.Tensor:
        return probabilities(logits, temperature, top_k, top_p)

    start = _clock(device)
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    width = int(lengths.max())
    cache = KVCache(target_config, batch, width + max_new_tokens + k + 1, dtype=cache_dtype, device=device)
    ids = torch.tensor([p + [0] * (width - len(p)) for p in prompts], device=device)
    positions = torch.arange(width, device=device).expand(batch, -1)
    hidden_all = target(ids, positions, cache)
    rows = torch.arange(batch, device=device)
    hidden = hidden_all[rows, lengths - 1]
    last = sample(dist(target.logits(hidden)), generator)
    pos = lengths.clone()

    stops = torch.tensor(sorted({*eos_token_ids, *stop_token_ids}), dtype=torch.long, device=device)
    out = torch.zeros(batch, max_new_tokens + k + 1, dtype=torch.long, device=device)
    out[:, 0] = last
    count = torch.ones(batch, dtype=torch.long, device=device)
    done = torch.isin(last, stops) | (count >= max_new_tokens)
    offsets = torch.arange(k + 1, device=device)
    accepted_log, active_log = [], []
    stats.prefill_time = _clock(device) - start

    while not bool(done.all()):  # the one host sync per round
        t0 = _clock(device)
        drafts, q, token, h = [], [], last, hidden
        for _ in range(k):
            h, normed = assistant(target.embed(token[:, None])[:, 0], h, pos, cache, target_config)
            q.append(dist(assistant.logits(normed, fill=float("-inf"))))
            token = sample(q[-1], generator)
            drafts.append(token)
        t1 = _clock(device)

        chunk = torch.stack([last, *drafts], dim=1)  # [B, k+1] at pos .. pos+k
        verified = target(chunk, pos[:, None] + offsets, cache)
        p = dist(target.logits(verified))  # p[:, j]: the target's distribution for pos + j + 1
        # q padded with a zero row: after k accepted drafts the residual at index k is p's bonus.
        q = torch.stack([*q, torch.zeros_like(p[:, 0])], dim=1)
        if k:
            d = chunk[:, 1:, None]
            ok = _accepts(p[:, :k].gather(-1, d)[..., 0], q[:, :k].gather(-1, d)[..., 0],
                          torch.rand(batch, k, device=device, generator=generator))
            accepted = ok.long().cumprod(dim=1).sum(dim=1)  # [B]: drafts before the first rejection
        else:
            accepted = torch.zeros(batch, dtype=torch.long, device=device)
        own = sample(_residual(p[rows, accepted], q[rows, accepted]), generator)
        # tokens[:, :accepted + 1]: the accepted drafts, then the round's own token.
        tokens = torch.cat([chunk[:, 1:], own[:, None]], dim=1).scatter_(1, accepted[:, None], own[:, None])
        active = ~done

        emit = accepted + 1
        is_stop = torch.isin(tokens, stops) & (offsets < emit[:, None])
        first_stop = torch.where(is_stop, offsets, k + 1).min(dim=1).values
        emit = torch.minimum(torch.minimum(emit, first_stop + 1), max_new_tokens - count)
        emit = torch.where(active, emit, 0)
        out.scatter_(1, count[:, None] + offsets, tokens)
        count = count + emit
        done = done | (is_stop & (offsets < emit[:, None])).any(dim=1) | (count >= max_new_tokens)

        last = torch.where(active, own, last)
        hidden = torch.where(active[:, None], verified[rows, accepted], hidden)
        pos = torch.where(active, pos + accepted + 1, pos)
        accepted_log.append(accepted)
        active_log.append(active)
        t2 = _clock(device)
        stats.draft_time += t1 - t0
        stats.verify_time += t2 - t1

    stats.rounds = len(accepted_log)
    if accepted_log:
        accepted_all, active_all = torch.stack(accepted_log, 1).cpu(), torch.stack(active_log, 1).cpu()
        stats.sequence_rounds = int(active_all.sum())
        per_position = (accepted_all[..., None] > torch.arange(k)) & active_all[..., None]
        stats.accepted_per_position = per_position.sum(dim=(0, 1)).tolist()
        stats.accepted_lengths = [accepted_all[b][active_all[b]].tolist() for b in range(batch)]
    else:
        stats.accepted_lengths = [[] for _ in prompts]
    counts = count.tolist()
    stats.tokens_generated = sum(counts)
    stats.total_time = _clock(device) - start
    return [row[:n] for row, n in zip(out.tolist(), counts)], stats
