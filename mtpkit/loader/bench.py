"""Measure a pair: acceptance and speed for each number of speculative tokens k, against target-only decoding.

Each k runs the same prompts, one at a time (batch 1, as a single user sees it), after one warm-up run;
speed is tokens/s over all prompts, and the speedup is against target-only decoding (k = 0) measured in the
same run. At temperature 0 every k must produce the target-only tokens (speculative decoding is exact); a
mismatch is reported rather than hidden. The recommended k is the fastest one.

`transformers_baseline` runs transformers' assisted generation (`generate(assistant_model=...)`, greedy,
`num_assistant_tokens=k`, constant schedule) on the same folders and prompts, for its tokens/s and tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from mtpkit.errors import ConfigError
from mtpkit.loader.pair import Pair


@dataclass
class KResult:
    k: int
    tokens: int
    seconds: float
    acceptance_per_position: list[float]
    mean_acceptance_length: float
    matches_target_only: bool
    speedup: float = 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


@dataclass
class BenchResult:
    prompts: int
    max_new_tokens: int
    target_only: KResult
    by_k: list[KResult]
    transformers: dict | None = None
    outputs: list[list[int]] = field(default_factory=list, repr=False)

    @property
    def recommended_k(self) -> int:
        return max(self.by_k, key=lambda r: r.speedup).k


def _run(pair: Pair, prompts: list, k: int, max_new_tokens: int) -> tuple[KResult, list[list[int]]]:
    pair.generate(prompts[:1], max_new_tokens=min(max_new_tokens, 8), num_speculative_tokens=k)  # warm-up
    outputs, accepted, rounds, tokens = [], [0] * k, 0, 0
    lengths: list[int] = []
    start = time.perf_counter()
    for prompt in prompts:
        [generation] = pair.generate([prompt], max_new_tokens=max_new_tokens, num_speculative_tokens=k)
        outputs.append(generation.token_ids)
        tokens += len(generation.token_ids)
        stats = generation.stats
        rounds += stats.sequence_rounds
        accepted = [a + b for a, b in zip(accepted, stats.accepted_per_position)]
        lengths += generation.accepted_lengths
    seconds = time.perf_counter() - start
    mean_length = (sum(lengths) + len(lengths)) / max(len(lengths), 1)
    return KResult(k, tokens, seconds, [a / max(rounds, 1) for a in accepted], mean_length, True), outputs


def bench_pair(pair: Pair, prompts: list, ks: list[int], max_new_tokens: int,
               on_k=None) -> BenchResult:
    """Target-only, then each k; `on_k(KResult)` after each (progress)."""
    ids = pair.encode(prompts)
    target_only, reference = _run(pair, ids, 0, max_new_tokens)
    target_only.speedup = 1.0
    if on_k:
        on_k(target_only)
    results = []
    for k in ks:
        result, outputs = _run(pair, ids, k, max_new_tokens)
        result.matches_target_only = outputs == reference
        result.speedup = result.tokens_per_second / target_only.tokens_per_second
        results.append(result)
        if on_k:
            on_k(result)
    return BenchResult(len(ids), max_new_tokens, target_only, results, outputs=reference)


@torch.inference_mode()
def transformers_baseline(pair: Pair, prompts: list, k: int, max_new_tokens: int, reference: list[list[int]]) -> dict:
    """transformers' assisted generation on the same pair folders (float32/bf16 as the pair was loaded)."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig, Gemma4AssistantForCausalLM

    kwargs = {}
    quantization = pair.target.quantization
    if quantization is not None and quantization["method"] != "compressed-tensors":
        raise ConfigError(f"transformers cannot load a {quantization['method']} checkpoint", where="--baseline",
                          fix="bench a BF16 or compressed-tensors pair against transformers")
    if quantization is not None:  # dequantized weights, unquantized activations: what our runtime computes
        kwargs["quantization_config"] = CompressedTensorsConfig(dequantize=True)
    target = AutoModelForCausalLM.from_pretrained(pair.target.checkpoint.folder, dtype=pair.target.dtype,
                                                  **kwargs).eval()
    assistant = Gemma4AssistantForCausalLM.from_pretrained(pair.draft.checkpoint.folder, dtype=pair.target.dtype).eval()
    assistant.generation_config.num_assistant_tokens = k
    assistant.generation_config.num_assistant_tokens_schedule = "constant"
    ids = pair.encode(prompts)
    eos = pair.eos_token_ids or None
    target.generate(torch.tensor([ids[0]]), assistant_model=assistant, do_sample=False, max_new_tokens=4,
                    eos_token_id=eos)  # warm-up
    outputs, tokens = [], 0
    start = time.perf_counter()
    for prompt in ids:
        out = target.generate(torch.tensor([prompt]), assistant_model=assistant, do_sample=False,
                              max_new_tokens=max_new_tokens, eos_token_id=eos)[0, len(prompt):].tolist()
        if eos:  # transformers pads nothing at batch 1, but keeps the EOS token, as we do
            cut = next((i for i, t in enumerate(out) if t in eos), None)
            out = out[:cut + 1] if cut is not None else out
        outputs.append(out)
        tokens += len(out)
    seconds = time.perf_counter() - start
    # transformers keeps its cache in the model dtype: with our FP8 cache the tokens may legitimately differ.
    comparable = pair.kv_cache_dtype != torch.float8_e4m3fn
    return {"k": k, "tokens": tokens, "seconds": seconds, "tokens_per_second": tokens / seconds if seconds else 0.0,
            "tokens_match": outputs == reference if comparable else None}
