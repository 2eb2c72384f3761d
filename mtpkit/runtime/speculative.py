"""Greedy generation with the target alone or with an MTP assistant drafting (speculative decoding).

One loop serves both: a round drafts k tokens (none without an assistant), then ONE target forward
verifies [last token, drafts] at positions pos .. pos+k, writing their K/V at those slots. The target's
argmax at each of the k+1 positions gives the tokens it would have generated; the drafts equal to
them form the accepted prefix, and the target's token after that prefix comes free (the bonus). With
k = 0 the round is plain greedy decoding, one token per forward.

Rejected drafts are undone by nothing: their slots lie at or after the next round's first position,
which the next verify overwrites before any target query reads them (a sliding ring masks them as
stale: kv_ring.py), and the assistant reads only positions strictly before its own (assistant.draft_mask).

Per sequence state between rounds, as transformers' SinglePositionMultiTokenCandidateGenerator keeps:
  last   the newest token, generated but not yet in the cache, at position `pos`
  hidden the target's final-norm hidden state of the token at pos - 1 (the last accepted one)
The assistant drafts from (target.embed(last), hidden) at the constant position pos.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from mtpkit.runtime.config import TextConfig
from mtpkit.runtime.kv_cache import KVCache
from mtpkit.runtime.model import Gemma4TextModel


@dataclass
class GenerationStats:
    """What a generate call did. Acceptance counts only sequence-rounds of sequences still running."""

    num_speculative_tokens: int
    rounds: int = 0  # target forwards after the prefill
    sequence_rounds: int = 0  # sum over sequences of the rounds they were running in
    accepted_per_position: list[int] = field(default_factory=list)  # draft j accepted (prefix rule)
    accepted_lengths: list[list[int]] = field(default_factory=list)  # per sequence, accepted drafts per round
    tokens_generated: int = 0  # output tokens, all sequences
    prefill_time: float = 0.0
    draft_time: float = 0.0
    verify_time: float = 0.0  # target forwards + acceptance bookkeeping after the prefill
    total_time: float = 0.0
    kv_cache_bytes: int = 0  # K/V storage the target's cache held (sliding layers: their ring)

    @property
    def acceptance_rate_per_position(self) -> list[float]:
        return [a / max(self.sequence_rounds, 1) for a in self.accepted_per_position]

    @property
    def accepted_tokens(self) -> int:
        return sum(self.accepted_per_position)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per target forward and sequence: accepted drafts + the target's own token."""
        return (self.accepted_tokens + self.sequence_rounds) / max(self.sequence_rounds, 1)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_generated / self.total_time if self.total_time > 0 else 0.0


def _clock(device: torch.device) -> float:
    # CUDA runs asynchronously: without a sync, times would be launch times.
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


# Called with (output buffer [B, N], tokens so far per row [B]) as tokens are accepted.
RoundCallback = Callable[[torch.Tensor, torch.Tensor], None]


class GreedyPolicy:
    """Greedy decoding: drafts are the assistant's greedy tokens, emitted tokens the target's argmax."""

    def __init__(self, assistant):
        self.assistant = assistant

    def first(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.argmax(-1)

    def draft(self, target, last, hidden, pos, cache, target_config, k):
        drafts, token, h = [], last, hidden
        for _ in range(k):  # k steps at the constant position pos, each feeding back its own output
            h, token = self.assistant.step(target.embed(token[:, None])[:, 0], h, pos, cache, target_config)
            drafts.append(token)
        return drafts, None

    def accept(self, target, chunk, verified, aux):
        """(tokens [B, k+1], accepted [B]): emit tokens[:, :accepted + 1]; tokens[:, accepted] comes next."""
        greedy = target.logits(verified).argmax(-1)  # greedy[:, j]: the target's token for pos + j + 1
        # Accepted drafts: the prefix on which draft j equals the target's token before it.
        accepted = (chunk[:, 1:] == greedy[:, :-1]).long().cumprod(dim=1).sum(dim=1)
        return greedy, accepted


@torch.inference_mode()
def generate_greedy(target: Gemma4TextModel, target_config: TextConfig, prompts: list[list[int]], *,
                    max_new_tokens: int, assistant=None, num_speculative_tokens: int = 4,
                    eos_token_ids: Sequence[int] = (), stop_token_ids: Sequence[int] = (),
                    cache_dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                    cache_scales: dict | None = None,
                    on_round: RoundCallback | None = None) -> tuple[list[list[int]], GenerationStats]:
    """Greedy continuations of `prompts` (new tokens only, each ending at its first stop token if any).

    `assistant`: anything with Gemma4Assistant.step's interface; None decodes with the target alone.
    The outputs equal the target-only ones whatever the assistant drafts: only the target's argmax
    is ever emitted. Sequences run batched (right-padded prefill); a finished one keeps riding along
    at a frozen position, its output frozen. `cache_scales`: an FP8 cache's k_scales / v_scales (KVCache).
    """
    return run_rounds(target, target_config, prompts, GreedyPolicy(assistant), max_new_tokens=max_new_tokens,
                      k=num_speculative_tokens if assistant is not None else 0, eos_token_ids=eos_token_ids,
                      stop_token_ids=stop_token_ids, cache_dtype=cache_dtype, device=resolve_device(target, device),
                      cache_scales=cache_scales, on_round=on_round)


def resolve_device(target: Gemma4TextModel, device: torch.device | str | None) -> torch.device:
    return torch.device(device) if device is not None else target.embed_tokens.weight.device


def run_rounds(target: Gemma4TextModel, target_config: TextConfig, prompts: list[list[int]], policy, *,
               max_new_tokens: int, k: int, eos_token_ids: Sequence[int], stop_token_ids: Sequence[int],
               cache_dtype: torch.dtype, device: torch.device, cache_scales: dict | None = None,
               on_round: RoundCallback | None = None) -> tuple[list[list[int]], GenerationStats]:
    """The loop greedy and sampled decoding share; `policy` picks the first token, drafts, and accepts.

    `on_round(out, count)`: after the first token and after each round, with the output buffer `[B, N]` and
    each row's token count `[B]` (device tensors; reading them syncs, so only streaming callers pass one).
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if k < 0 or max_new_tokens < 0:
        raise ValueError("num_speculative_tokens and max_new_tokens must be >= 0")
    stats = GenerationStats(num_speculative_tokens=k, accepted_per_position=[0] * k)
    batch = len(prompts)
    if max_new_tokens == 0:
        stats.accepted_lengths = [[] for _ in prompts]
        return [[] for _ in prompts], stats
    start = _clock(device)

    lengths = torch.tensor([len(p) for p in prompts], device=device)
    width = int(lengths.max())
    # Room for the longest prompt, every output token, and one verify chunk running past the end.
    # Sliding layers keep a ring of window + k + 1 slots: a verify chunk writes k + 1 tokens past the
    # accepted ones, and the draft's sliding mask reaches one slot further back than the target's.
    cache = KVCache(target_config, batch, width + max_new_tokens + k + 1, dtype=cache_dtype, device=device,
                    sliding_slack=k + 2, **(cache_scales or {}))
    ids = torch.tensor([p + [0] * (width - len(p)) for p in prompts], device=device)
    positions = torch.arange(width, device=device).expand(batch, -1)  # padding continues each row (kv_cache.py)
    hidden_all = target(ids, positions, cache, valid=positions < lengths[:, None])
    stats.kv_cache_bytes = cache.nbytes()
    rows = torch.arange(batch, device=device)
    hidden = hidden_all[rows, lengths - 1]  # the last prompt token's: the one before `last`
    last = policy.first(target.logits(hidden))
    pos = lengths.clone()

    stops = torch.tensor(sorted({*eos_token_ids, *stop_token_ids}), dtype=torch.long, device=device)
    out = torch.zeros(batch, max_new_tokens + k + 1, dtype=torch.long, device=device)  # + a chunk of slack
    out[:, 0] = last
    count = torch.ones(batch, dtype=torch.long, device=device)
    done = torch.isin(last, stops) | (count >= max_new_tokens)
    offsets = torch.arange(k + 1, device=device)
    accepted_log, active_log = [], []
    stats.prefill_time = _clock(device) - start
    if on_round:
        on_round(out, count)

    while not bool(done.all()):  # the one host sync per round: whether to go on
        t0 = _clock(device)
        drafts, aux = policy.draft(target, last, hidden, pos, cache, target_config, k)
        t1 = _clock(device)

        chunk = torch.stack([last, *drafts], dim=1)  # [B, k+1] at pos .. pos+k
        verified = target(chunk, pos[:, None] + offsets, cache)
        tokens, accepted = policy.accept(target, chunk, verified, aux)
        active = ~done

        # Emit tokens[:, :accepted + 1], cut after a stop token and at max_new_tokens.
        emit = accepted + 1
        is_stop = torch.isin(tokens, stops) & (offsets < emit[:, None])
        first_stop = torch.where(is_stop, offsets, k + 1).min(dim=1).values
        emit = torch.minimum(torch.minimum(emit, first_stop + 1), max_new_tokens - count)
        emit = torch.where(active, emit, 0)
        # Writing the whole chunk is harmless: slots from count + emit on are rewritten or never read
        # (a finished row's count is frozen, so its output is too).
        out.scatter_(1, count[:, None] + offsets, tokens)
        count = count + emit
        done = done | (is_stop & (offsets < emit[:, None])).any(dim=1) | (count >= max_new_tokens)

        # Next round: the new last token is the one after the accepted prefix; the hidden state is
        # that of the token before it, the last accepted one, at chunk index `accepted`.
        last = torch.where(active, tokens[rows, accepted], last)
        hidden = torch.where(active[:, None], verified[rows, accepted], hidden)
        pos = torch.where(active, pos + accepted + 1, pos)
        accepted_log.append(accepted)
        active_log.append(active)
        if on_round:
            on_round(out, count)
        t2 = _clock(device)
        stats.draft_time += t1 - t0
        stats.verify_time += t2 - t1

    stats.rounds = len(accepted_log)
    if accepted_log:
        accepted_all, active_all = torch.stack(accepted_log, 1).cpu(), torch.stack(active_log, 1).cpu()
        stats.sequence_rounds = int(active_all.sum())
        # Draft j (0-based) was accepted in a round iff the accepted prefix is longer than j.
        per_position = (accepted_all[..., None] > torch.arange(k)) & active_all[..., None]
        stats.accepted_per_position = per_position.sum(dim=(0, 1)).tolist()
        stats.accepted_lengths = [accepted_all[b][active_all[b]].tolist() for b in range(batch)]
    else:
        stats.accepted_lengths = [[] for _ in prompts]
    counts = count.tolist()
    outputs = [row[:n] for row, n in zip(out.tolist(), counts)]
    stats.tokens_generated = sum(counts)
    stats.total_time = _clock(device) - start
    return outputs, stats
