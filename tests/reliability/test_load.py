"""Load: a batch of 32 prompts of mixed lengths (many past the sliding window) decodes as each prompt does alone,
and the KV cache holds exactly what its layout predicts (full layers: every position; sliding layers: a ring)."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from mtpkit.runtime import Gemma4Assistant, Gemma4TextModel, KVCache, TextConfig, generate_greedy, \
    load_assistant_state_dict, load_text_state_dict


def _load(tiny):
    folder, draft_folder = tiny("e2b_like"), tiny("assistant_centroids")
    target = Gemma4TextModel(TextConfig.from_dict(json.loads((folder / "config.json").read_text()))).eval()
    load_text_state_dict(target, load_file(folder / "model.safetensors"))
    draft = Gemma4Assistant(json.loads((draft_folder / "config.json").read_text())).eval()
    load_assistant_state_dict(draft, load_file(draft_folder / "model.safetensors"))
    return target, draft


def _assert_near_tie(target, tokens: list[int], choices: set[int]) -> None:
    """Where batched and alone runs pick different tokens, the two logits must tie to float32 noise
    (a batch of 32 changes the matmul blocking, hence the last bits)."""
    with torch.inference_mode():
        cache = KVCache(target.config, 1, len(tokens))
        logits = target.logits(target(torch.tensor([tokens]), torch.arange(len(tokens))[None], cache))[0, -1]
    a, b = (float(logits[t]) for t in choices)
    assert abs(a - b) < 1e-5 and max(a, b) >= float(logits.max()) - 1e-5, (a, b, float(logits.max()))


def test_batch_of_32_mixed_lengths(tiny):
    target, draft = _load(tiny)
    config = target.config
    g = torch.Generator().manual_seed(9)
    lengths = torch.randint(1, 41, (32,), generator=g).tolist()  # window 8: most prompts run past it
    prompts = [torch.randint(3, 120, (n,), generator=g).tolist() for n in lengths]
    k, new = 3, 8
    batched, stats = generate_greedy(target, config, prompts, max_new_tokens=new, assistant=draft,
                                     num_speculative_tokens=k)
    target_only, _ = generate_greedy(target, config, prompts, max_new_tokens=new)
    assert batched == target_only  # speculative decoding is exact, row by row, at batch 32
    assert all(len(out) == new for out in batched)
    for prompt, got in zip(prompts[:4], batched[:4]):  # each alone: the same, up to float32 near-ties
        alone, _ = generate_greedy(target, config, [prompt], max_new_tokens=new)
        if got != alone[0]:
            step = next(i for i, (a, b) in enumerate(zip(got, alone[0])) if a != b)
            _assert_near_tie(target, prompt + alone[0][:step], {got[step], alone[0][step]})
    # The cache's bytes, from its layout alone.
    max_len, ring = max(lengths) + new + k + 1, config.sliding_window + k + 2 + 1
    predicted = 0
    for layer in range(config.num_hidden_layers):
        if config.is_kv_shared(layer):
            continue
        spec = config.spec(layer)
        slots = ring if config.layer_types[layer] == "sliding_attention" else max_len
        predicted += 2 * 32 * spec.num_key_value_heads * slots * spec.head_dim * 4  # k and v, float32
    assert stats.kv_cache_bytes == predicted
