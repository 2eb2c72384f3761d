"""Sliding-window layers kept as a ring: the same logits as the full-length cache, in a fraction of the memory.

The full-length cache is checked against transformers in test_model.py; here the ring must reproduce it
through everything decoding does to a cache: a batch of prompts of different lengths (padding), a prefill
longer than the ring, verify chunks whose drafts are partly rejected (stale slots), and the assistant's
reads, in float32 and with an FP8 cache.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from mtpkit.runtime import Gemma4Assistant, Gemma4TextModel, KVCache, TextConfig, load_assistant_state_dict, \
    load_text_state_dict
from mtpkit.runtime.kv_cache import FP8

TARGETS = ["e2b_like", "moe_26b_like", "dense_31b_like", "multimodal"]
SLACK = 3  # a verify chunk of 3 tokens (k = 2) plus the draft's one extra slot: the rule speculative.py uses
MAX_LEN = 48


def _target(tiny, name):
    folder = tiny(name)
    model = Gemma4TextModel(TextConfig.from_dict(json.loads((folder / "config.json").read_text()))).eval()
    load_text_state_dict(model, load_file(folder / "model.safetensors"))
    return model


def _caches(model, dtype):
    full = KVCache(model.config, 2, MAX_LEN, dtype=dtype)
    ring = KVCache(model.config, 2, MAX_LEN, dtype=dtype, sliding_slack=SLACK)
    return full, ring


@pytest.mark.parametrize("dtype", [torch.float32, FP8])
@pytest.mark.parametrize("name", TARGETS)
def test_ring_equals_full_cache_through_prefill_verify_and_rejection(tiny, name, dtype):
    model = _target(tiny, name)
    window = model.config.sliding_window
    full, ring = _caches(model, dtype)
    assert ring.ring is not None and ring.ring.size == window + SLACK < MAX_LEN
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([19, 6])  # 19 > the ring: its early keys only live in the prefill's own view
    width = int(lengths.max())
    ids = torch.randint(3, 120, (2, width), generator=g)
    positions = torch.arange(width).expand(2, -1)
    valid = positions < lengths[:, None]
    with torch.inference_mode():
        a = model.logits(model(ids, positions, full))
        b = model.logits(model(ids, positions, ring, valid=valid))
    # Equal up to float32 summation order: the ring attends other (fewer) masked keys. Measured < 2e-6.
    for row, n in enumerate(lengths.tolist()):
        torch.testing.assert_close(b[row, :n], a[row, :n], rtol=0, atol=1e-5)
    pos = lengths.clone()
    for round_ in range(12):  # verify chunks of 3; accept a random prefix, so some drafts go stale
        chunk = torch.randint(3, 120, (2, 3), generator=g)
        at = pos[:, None] + torch.arange(3)
        with torch.inference_mode():
            a = model.logits(model(chunk, at, full))
            b = model.logits(model(chunk, at, ring))
        assert float((b - a).abs().max()) < 1e-5, (round_, float((b - a).abs().max()))
        pos = pos + 1 + torch.randint(0, 3, (2,), generator=g)
    held = {layer for layer in range(model.config.num_hidden_layers) if ring.k[layer] is not None
            and ring.k[layer].shape[2] == window + SLACK + 1}
    assert held and held == ring.ring_layers
    assert ring.nbytes() < full.nbytes() and ring.bytes_per_token() == full.bytes_per_token()


def test_assistant_reads_the_ring_as_the_full_cache(tiny):
    target = _target(tiny, "e2b_like")
    folder = tiny("assistant_centroids")
    assistant = Gemma4Assistant(json.loads((folder / "config.json").read_text())).eval()
    load_assistant_state_dict(assistant, load_file(folder / "model.safetensors"))
    full, ring = _caches(target, torch.float32)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 120, (2, 21), generator=g)
    positions = torch.arange(21).expand(2, -1)
    with torch.inference_mode():
        hidden = target(ids, positions, full)
        target(ids, positions, ring)
        pos = torch.tensor([21, 21])
        for step in range(3):  # the draft position stays; the hidden state is fed back
            token = target.embed(torch.randint(3, 120, (2, 1), generator=g))[:, 0]
            a, _ = assistant(token, hidden[:, -1], pos, full, target.config)
            b, _ = assistant(token, hidden[:, -1], pos, ring, target.config)
            torch.testing.assert_close(b, a, rtol=0, atol=1e-5, msg=f"step {step}")


def test_generation_keeps_sliding_layers_in_a_ring(tiny):
    """generate_greedy: a long prompt decodes as with a full cache (transformers' tokens, test_speculative),
    and the stats report the ring's smaller footprint."""
    from mtpkit.runtime import generate_greedy

    target = _target(tiny, "dense_31b_like")
    prompt = torch.randint(3, 120, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    tokens, stats = generate_greedy(target, target.config, [prompt], max_new_tokens=8)
    full = KVCache(target.config, 1, 40 + 8 + 0 + 1)  # what the cache would hold without the ring (k = 0)
    assert 0 < stats.kv_cache_bytes < full.nbytes()
    with torch.inference_mode():  # the plain full-cache greedy loop, token by token
        cache, ids, expected = KVCache(target.config, 1, 64), torch.tensor([prompt]), []
        logits = target.logits(target(ids, torch.arange(40)[None], cache))[:, -1]
        for i in range(8):
            expected.append(int(logits.argmax(-1)))
            logits = target.logits(target(torch.tensor([[expected[-1]]]), torch.tensor([[40 + i]]), cache))[:, -1]
    assert tokens[0] == expected
