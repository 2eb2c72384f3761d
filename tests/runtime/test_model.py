"""Gemma4TextModel + KVCache against transformers (the oracle), on every tiny target fixture.

transformers runs each prompt alone (batch 1, no padding, no cache, eager attention, eager experts),
so its logits at position p are the ground truth for a token at p; ours run batched, padded, and
through the static cache. Fixtures use sliding_window 8, so sequences past 8 tokens exercise it.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import Gemma4ForCausalLM, Gemma4ForConditionalGeneration

from mtpkit.runtime import Gemma4TextModel, KVCache, TextConfig, load_text_state_dict

TARGETS = ["e2b_like", "moe_26b_like", "dense_31b_like", "multimodal", "text_only"]
FP32 = {"atol": 1e-5, "rtol": 1e-5}
# bf16: two bf16 steps at the logit scale of these fixtures (|logit| < 1). transformers' own bf16
# logits differ from its float32 ones by 0.01-0.06 here; ours equal its bf16 ones (0.0 on CPU: same
# ops in the same order), the slack is for other BLAS builds.
BF16 = {"atol": 1e-2, "rtol": 1.6e-2}
PAD = 0


@pytest.fixture(scope="module")
def models(tiny):
    """models(name, dtype) -> (ours, transformers'), loaded once per module."""
    loaded = {}

    def get(name: str, dtype: torch.dtype = torch.float32):
        if (name, dtype) not in loaded:
            folder = tiny(name)
            config = json.loads((folder / "config.json").read_text())
            ours = Gemma4TextModel(TextConfig.from_dict(config)).to(dtype).eval()
            load_text_state_dict(ours, load_file(folder / "model.safetensors"))
            cls = Gemma4ForConditionalGeneration if config["model_type"] == "gemma4" else Gemma4ForCausalLM
            ref = cls.from_pretrained(folder, dtype=dtype, attn_implementation="eager",
                                      experts_implementation="eager").eval()
            loaded[name, dtype] = ours, ref
        return loaded[name, dtype]

    return get


def prompts(*lengths: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 120, (n,), generator=g) for n in lengths]  # no pad/eos/bos, no media tokens


@torch.inference_mode()
def reference(ref, tokens: torch.Tensor) -> torch.Tensor:
    return ref(tokens[None]).logits[0].float()


def batch(seqs: list[torch.Tensor], starts: list[int], align: str = "right") -> tuple[torch.Tensor, torch.Tensor]:
    """ids, positions `[B, T]` for seqs[b] starting at position starts[b], padded to the longest.

    Padding tokens take the positions after their row's real tokens (kv_cache.py's rule), whether
    they sit after (right) or before (left) the real tokens in the batch tensor.
    """
    width = max(len(s) for s in seqs)
    ids, positions = [], []
    for seq, start in zip(seqs, starts):
        pad = width - len(seq)
        real_pos = torch.arange(start, start + len(seq))
        pad_pos = torch.arange(start + len(seq), start + width)
        pads = torch.full((pad,), PAD)
        if align == "right":
            ids.append(torch.cat([seq, pads]))
            positions.append(torch.cat([real_pos, pad_pos]))
        else:
            ids.append(torch.cat([pads, seq]))
            positions.append(torch.cat([pad_pos, real_pos]))
    return torch.stack(ids), torch.stack(positions)


def real(logits: torch.Tensor, row: int, n: int, width: int, align: str = "right") -> torch.Tensor:
    """The n real tokens' logits of one row of a padded batch."""
    return logits[row, :n] if align == "right" else logits[row, width - n:]


@torch.inference_mode()
def step(model, cache, seqs, starts, align="right") -> list[torch.Tensor]:
    """One forward over seqs[b] at starts[b]..; each row's real-token logits (float32)."""
    ids, positions = batch(seqs, starts, align)
    logits = model.logits(model(ids, positions, cache)).float()
    return [real(logits, b, len(s), ids.shape[1], align) for b, s in enumerate(seqs)]


@pytest.mark.parametrize("align", ["right", "left"])
@pytest.mark.parametrize("name", TARGETS)
def test_prefill_batch_of_different_lengths(models, name, align):
    ours, ref = models(name)
    seqs = prompts(13, 6)  # 13 > sliding window 8
    cache = KVCache(ours.config, 2, 16)
    for seq, got in zip(seqs, step(ours, cache, seqs, [0, 0], align)):
        torch.testing.assert_close(got, reference(ref, seq), **FP32)


@pytest.mark.parametrize("name", TARGETS)
def test_decode_one_token_at_a_time(models, name):
    """Prefill 5 tokens (3 in the second row), then 6 single-token steps through the cache."""
    ours, ref = models(name)
    full = prompts(11, 9, seed=1)
    expected = [reference(ref, seq) for seq in full]
    prefill = [5, 3]
    cache = KVCache(ours.config, 2, 16)
    got = step(ours, cache, [seq[:n] for seq, n in zip(full, prefill)], [0, 0])
    for b, n in enumerate(prefill):
        torch.testing.assert_close(got[b], expected[b][:n], **FP32)
    for i in range(6):
        pos = [n + i for n in prefill]
        got = step(ours, cache, [seq[p:p + 1] for seq, p in zip(full, pos)], pos)
        for b, p in enumerate(pos):
            torch.testing.assert_close(got[b][0], expected[b][p], **FP32)


@pytest.mark.parametrize("name", TARGETS)
def test_rejected_draft_tokens_are_overwritten(models, name):
    """Verify-style chunks: 3 wrong tokens, then the right ones at the same positions."""
    ours, ref = models(name)
    seq = prompts(12, seed=2)[0]
    expected = reference(ref, seq)
    cache = KVCache(ours.config, 1, 16)
    step(ours, cache, [seq[:6]], [0])
    step(ours, cache, [torch.tensor([7, 8, 9])], [6])  # drafts that the target rejects
    got = step(ours, cache, [seq[6:9]], [6])  # the caller rewinds its length to 6
    torch.testing.assert_close(got[0], expected[6:9], **FP32)
    got = step(ours, cache, [seq[9:12]], [9])
    torch.testing.assert_close(got[0], expected[9:12], **FP32)


@pytest.mark.parametrize("name", TARGETS)
def test_longer_than_the_sliding_window(models, name):
    """24 tokens (3 windows) in chunks of 10, 7, 7; a model without the window would differ."""
    ours, ref = models(name)
    seq = prompts(24, seed=3)[0]
    expected = reference(ref, seq)
    cache = KVCache(ours.config, 1, 24)
    got = torch.cat([step(ours, cache, [seq[a:b]], [a])[0] for a, b in ((0, 10), (10, 17), (17, 24))])
    torch.testing.assert_close(got, expected, **FP32)

    # The test has teeth: ignoring the window moves the logits of tokens past it.
    unwindowed = Gemma4TextModel(dataclasses.replace(ours.config, sliding_window=1000)).eval()
    unwindowed.load_state_dict(ours.state_dict())
    no_window = step(unwindowed, KVCache(ours.config, 1, 24), [seq], [0])[0]
    torch.testing.assert_close(no_window[:8], expected[:8], **FP32)
    assert (no_window[8:] - expected[8:]).abs().max() > 100 * FP32["atol"]


@pytest.mark.parametrize("name", TARGETS)
def test_bfloat16(models, name):
    ours, ref = models(name, torch.bfloat16)
    seqs = prompts(13, 6, seed=4)
    expected = [reference(ref, seq) for seq in seqs]
    cache = KVCache(ours.config, 2, 16, dtype=torch.bfloat16)
    for got, want, n in zip(step(ours, cache, [s[:10] for s in seqs], [0, 0]), expected, [10, 6]):
        torch.testing.assert_close(got, want[:n], **BF16)
    got = step(ours, cache, [seqs[0][10:13], seqs[1][3:6]], [10, 3])  # continue / overwrite through the cache
    torch.testing.assert_close(got[0], expected[0][10:13], **BF16)
    torch.testing.assert_close(got[1], expected[1][3:6], **BF16)


def test_embed_is_the_scaled_embedding_in_the_model_dtype(models):
    ours, ref = models("e2b_like", torch.bfloat16)
    ids = prompts(5)[0][None]
    with torch.inference_mode():
        assert torch.equal(ours.embed(ids), ref.model.embed_tokens(ids))
    # sqrt(64) is exact; the scale is rounded to bf16 before multiplying, as transformers does.
    assert ours.embed_tokens.scale.to(torch.bfloat16) == 8.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", TARGETS)
def test_cuda_runs_the_same_code(models, name):
    ours, ref = models(name)
    full = prompts(11, 9, seed=5)
    expected = [reference(ref, seq) for seq in full]
    model = Gemma4TextModel(ours.config).cuda().eval()
    model.load_state_dict(ours.state_dict())
    cache = KVCache(ours.config, 2, 16, device="cuda")
    with torch.inference_mode():
        ids, positions = batch([seq[:8] for seq in full], [0, 0])
        first = model.logits(model(ids.cuda(), positions.cuda(), cache)).float().cpu()
        ids, positions = batch([full[0][8:11], full[1][6:9]], [8, 6])
        second = model.logits(model(ids.cuda(), positions.cuda(), cache)).float().cpu()
    tol = {"atol": 1e-4, "rtol": 1e-4}  # CUDA BLAS sums in another order than the CPU
    torch.testing.assert_close(first[0], expected[0][:8], **tol)
    torch.testing.assert_close(first[1, :8], expected[1][:8], **tol)
    torch.testing.assert_close(second[0], expected[0][8:11], **tol)
    torch.testing.assert_close(second[1], expected[1][6:9], **tol)
