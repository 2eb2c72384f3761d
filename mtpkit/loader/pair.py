"""`load_pair` and the Pair it returns: generate (batched, greedy or sampled, speculative), stream, describe."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mtpkit.convert.describe import describe as describe_checkpoint
from mtpkit.convert.pair import recommended_tokens
from mtpkit.errors import ConfigError
from mtpkit.loader.load import (KV_CACHE_DTYPES, LoadedDraft, LoadedTarget, load_draft, load_target, open_resolved,
                                pair_folders, validate_pair)
from mtpkit.loader.memory import parse_bytes
from mtpkit.loader.prompts import cut_at_stop, decode, encode_prompts, eos_token_ids, load_tokenizer, stop_rule
from mtpkit.runtime import GenerationStats, generate_greedy, generate_sampled
from mtpkit.runtime.assistant import kv_producers_of
from mtpkit.runtime.kv_cache import FP8


@dataclass
class Generation:
    """One prompt's continuation."""

    text: str  # "" when the pair has no tokenizer
    token_ids: list[int]
    prompt_token_ids: list[int]
    accepted_lengths: list[int]  # drafts accepted in each round this sequence ran
    stats: GenerationStats = field(repr=False)  # of the whole batch it ran in

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per target forward for this sequence (accepted drafts + the target's own)."""
        return (sum(self.accepted_lengths) + len(self.accepted_lengths)) / max(len(self.accepted_lengths), 1)


class Pair:
    """A target and its assistant, loaded and checked, with the target's tokenizer."""

    def __init__(self, target: LoadedTarget, draft: LoadedDraft | None, kv_cache_dtype: str = "auto"):
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype {kv_cache_dtype!r} is not one of {', '.join(KV_CACHE_DTYPES)}",
                              where="kv_cache_dtype", fix="use auto, bf16 or fp8")
        self.target, self.draft = target, draft
        self.tokenizer = load_tokenizer(target.checkpoint.folder)
        self.eos_token_ids = eos_token_ids(target.checkpoint.folder, target.checkpoint.config)
        fp8 = kv_cache_dtype == "fp8" or (kv_cache_dtype == "auto" and target.kv_scales is not None)
        self.kv_cache_dtype = FP8 if fp8 else (torch.bfloat16 if kv_cache_dtype == "bf16" else target.dtype)
        # FP8 without the checkpoint's scales: each layer's scale is its prefill amax / 448 (kv_cache.py).
        self.cache_scales = target.kv_scales if fp8 else None
        self.num_speculative_tokens, self.tokens_why = recommended_tokens(target.checkpoint.config)
        self.findings = draft.findings if draft else []

    def encode(self, prompts, *, chat: bool = False) -> list[list[int]]:
        """Prompts (strings, token ids, or a list of either) as the token id lists generate runs."""
        return encode_prompts(prompts, self.tokenizer, chat=chat, vocab_size=self.target.config.vocab_size)

    def generate(self, prompts, *, max_new_tokens: int = 256, num_speculative_tokens: int | None = None,
                 temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                 stop=None, chat: bool = False,
                 on_text: Callable[[int, str], None] | None = None) -> list[Generation]:
        """Continue each prompt (a string, token ids, or a list of either), batched.

        temperature 0 is greedy (outputs equal the target's own greedy decoding); otherwise speculative
        sampling that keeps the target's distribution. `num_speculative_tokens` defaults to the published
        setting for the target (0: the target alone). `on_text(i, piece)` receives prompt i's text as rounds
        are accepted.
        """
        k = self.num_speculative_tokens if num_speculative_tokens is None else num_speculative_tokens
        if k < 0 or max_new_tokens < 0:
            raise ConfigError("num_speculative_tokens and max_new_tokens must be >= 0", where="generate",
                              fix="pass non-negative values")
        if k and self.draft is None:
            raise ConfigError("num_speculative_tokens > 0 needs an assistant", where="generate",
                              fix="load a pair (draft=...), or pass num_speculative_tokens=0")
        ids = self.encode(prompts, chat=chat)
        rule = stop_rule(stop, self.tokenizer)
        kwargs = dict(max_new_tokens=max_new_tokens, assistant=self.draft.model if k else None,
                      num_speculative_tokens=k, eos_token_ids=self.eos_token_ids, stop_token_ids=rule.token_ids,
                      cache_dtype=self.kv_cache_dtype, device=self.target.device, cache_scales=self.cache_scales,
                      on_round=self._streamer(len(ids), rule, on_text) if on_text else None)
        if temperature == 0:
            outputs, stats = generate_greedy(self.target.model, self.target.config, ids, **kwargs)
        else:
            outputs, stats = generate_sampled(self.target.model, self.target.config, ids, temperature=temperature,
                                              top_k=top_k, top_p=top_p, seed=seed, **kwargs)
        results = []
        for i, (prompt, out) in enumerate(zip(ids, outputs)):
            text, cut = cut_at_stop(decode(self.tokenizer, out), rule)
            while cut and out and not text.startswith(decode(self.tokenizer, out)):
                out = out[:-1]  # keep the tokens whose text lies before the stop string
            results.append(Generation(text, out, prompt, stats.accepted_lengths[i], stats))
        return results

    def _streamer(self, rows: int, rule, on_text: Callable[[int, str], None]):
        sent = [""] * rows

        def on_round(out: torch.Tensor, count: torch.Tensor) -> None:
            for row, n in enumerate(count.tolist()):
                text, _ = cut_at_stop(decode(self.tokenizer, out[row, :n].tolist()), rule)
                # Hold back a trailing partial character (a multi-byte token split across rounds).
                if text.endswith("\ufffd") or len(text) <= len(sent[row]) or not text.startswith(sent[row]):
                    continue
                on_text(row, text[len(sent[row]):])
                sent[row] = text
        return on_round

    def stream(self, prompt, **kwargs) -> Iterator[str]:
        """Yield one prompt's text as it is accepted (generate's arguments; runs in a worker thread)."""
        pieces: queue.Queue = queue.Queue()
        done = object()
        failure: list[BaseException] = []

        def work() -> None:
            try:
                self.generate(prompt, on_text=lambda _row, piece: pieces.put(piece), **kwargs)
            except BaseException as e:  # handed to the consumer, raised there
                failure.append(e)
            finally:
                pieces.put(done)

        threading.Thread(target=work, daemon=True).start()
        while (piece := pieces.get()) is not done:
            yield piece
        if failure:
            raise failure[0]

    def describe(self) -> dict:
        """Formats, sizes, the KV map, the cache dtype and the memory the loaded pair holds."""
        target = describe_checkpoint(self.target.checkpoint)
        summary = {
            "device": str(self.target.device), "dtype": str(self.target.dtype).removeprefix("torch."),
            "target": {"folder": str(self.target.checkpoint.folder), "quantization": self.target.quantization,
                       "parameters": target.num_parameters, "bytes_loaded": self.target.nbytes},
            "kv_cache": {"dtype": str(self.kv_cache_dtype).removeprefix("torch."),
                         "scales": "checkpoint" if self.cache_scales else ("prefill amax" if self.kv_cache_dtype == FP8
                                                                           else None)},
            "num_speculative_tokens": {"value": self.num_speculative_tokens, "why": self.tokens_why},
            "tokenizer": self.tokenizer is not None,
            "warnings": [f.to_json() for f in self.findings],
        }
        if self.draft is not None:
            draft = describe_checkpoint(self.draft.checkpoint)
            summary["draft"] = {"folder": str(self.draft.checkpoint.folder), "parameters": draft.num_parameters,
                                "bytes_loaded": self.draft.nbytes,
                                "centroids": self.draft.model.use_ordered_embeddings}
            producers = kv_producers_of(self.target.config)
            summary["kv_map"] = {f"draft layer {i}": f"target layer {producers[t]} ({t})"
                                 for i, t in enumerate(self.draft.model.config.layer_types)}
        return summary


def load_pair(pair_dir_or_repo: str | Path | None = None, *, target: str | Path | None = None,
              draft: str | Path | None = None, revision: str | None = None, device: str | torch.device = "auto",
              dtype: str | torch.dtype = "bfloat16", kv_cache_dtype: str = "auto", local_files_only: bool = False,
              max_memory: str | int | None = None) -> Pair:
    """A pair folder or Hub repo (`mtp-convert pair` output), or target= and draft= separately."""
    if (pair_dir_or_repo is None) == (target is None or draft is None):
        raise ConfigError("give a pair folder or repo, or both target= and draft=", where="load_pair",
                          fix="e.g. load_pair('OUT') or load_pair(target='T', draft='D')")
    revisions = (revision, revision) if pair_dir_or_repo is None else (None, None)
    if pair_dir_or_repo is not None:
        target, draft = pair_folders(pair_dir_or_repo, revision, local_files_only)
    # Validate on the headers before reading gigabytes: the check rules need only configs and tensor names.
    target_ck = open_resolved(target, revisions[0], local_files_only)
    draft_ck = open_resolved(draft, revisions[1], local_files_only)
    findings = validate_pair(target_ck, draft_ck)
    loaded_target = load_target(target, revision=revisions[0], device=device, dtype=dtype,
                                local_files_only=local_files_only, max_memory=max_memory)
    remaining = None if max_memory is None else max(0, parse_bytes(max_memory) - loaded_target.nbytes)
    loaded_draft = load_draft(draft, revision=revisions[1], device=loaded_target.device, dtype=dtype,
                              local_files_only=local_files_only, max_memory=remaining)
    loaded_draft.findings = findings
    try:
        loaded_draft.model.check_target(loaded_target.config)
    except ValueError as e:
        raise ConfigError(str(e), where=f"{target_ck.folder} + {draft_ck.folder}",
                          fix="run `mtp-convert check` on the pair") from None
    return Pair(loaded_target, loaded_draft, kv_cache_dtype)
