"""Gemma4Assistant against transformers' Gemma4AssistantForCausalLM (the oracle), on both tiny pairs.

transformers drives the assistant as SinglePositionMultiTokenCandidateGenerator does: the target's
shared K/V (return_shared_kv_states) of a prompt, the target embedding of the last token, the target
(then the assistant's own) hidden state, and a position held constant over the round. Ours reads
the same K/V out of our target's static KVCache, batched and padded. Prompts of 13 tokens pass the
sliding window (8) plus the one extra slot transformers' draft mask keeps.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import Gemma4ForCausalLM
from transformers.generation.candidate_generator import SinglePositionMultiTokenCandidateGenerator
from transformers.models.gemma4_assistant import Gemma4AssistantForCausalLM

import mtpkit.runtime.assistant as assistant_module
from mtpkit.errors import ConfigError
from mtpkit.runtime import Gemma4Assistant, Gemma4TextModel, KVCache, TextConfig, load_assistant_state_dict
from mtpkit.runtime import load_text_state_dict
from mtpkit.runtime.assistant import draft_mask, kv_producers_of

PAIRS = [("e2b_like", "assistant_centroids"), ("dense_31b_like", "assistant_plain")]
FP32 = {"atol": 1e-5, "rtol": 1e-5}
BF16 = {"atol": 1e-2, "rtol": 1.6e-2}  # as tests/runtime/test_model.py
STEPS = 4  # the fixtures' num_assistant_tokens
PAD = 0


def _json(folder) -> dict:
    return json.loads((folder / "config.json").read_text())


@pytest.fixture(scope="module")
def pair(tiny):
    """pair(target, assistant, dtype) -> (our target, our assistant, transformers' target, transformers' assistant)."""
    loaded = {}

    def get(target: str, assistant: str, dtype: torch.dtype = torch.float32):
        if (target, assistant, dtype) not in loaded:
            ours = Gemma4TextModel(TextConfig.from_dict(_json(tiny(target)))).to(dtype).eval()
            load_text_state_dict(ours, load_file(tiny(target) / "model.safetensors"))
            draft = Gemma4Assistant(_json(tiny(assistant))).to(dtype).eval()
            load_assistant_state_dict(draft, load_file(tiny(assistant) / "model.safetensors"))
            kw = {"dtype": dtype, "attn_implementation": "eager"}
            ref = Gemma4ForCausalLM.from_pretrained(tiny(target), **kw).eval()
            ref_draft = Gemma4AssistantForCausalLM.from_pretrained(tiny(assistant), **kw).eval()
            loaded[target, assistant, dtype] = ours, draft, ref, ref_draft
        return loaded[target, assistant, dtype]

    return get


def prompts(*lengths: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 120, (n,), generator=g) for n in lengths]


@torch.inference_mode()
def prefill(target: Gemma4TextModel, seqs: list[torch.Tensor], max_len: int = 24):
    """Right-padded batch prefill (padding continues each row's positions, kv_cache.py's rule).

    Returns the cache, each row's last real hidden state `[B, H]` and its greedy next token `[B]`.
    """
    width = max(len(s) for s in seqs)
    ids = torch.stack([torch.cat([s, torch.full((width - len(s),), PAD)]) for s in seqs])
    positions = torch.arange(width).expand(len(seqs), -1)
    cache = KVCache(target.config, len(seqs), max_len, dtype=target.embed_tokens.weight.dtype)
    hidden = target(ids, positions, cache)
    last = torch.stack([hidden[b, len(s) - 1] for b, s in enumerate(seqs)])
    return cache, last, target.logits(last).argmax(-1)


@torch.inference_mode()
def reference_round(ref, ref_draft, seq: torch.Tensor, inputs=None):
    """transformers' first draft round for one prompt, as the candidate generator runs it.

    Returns per step: (token fed in, hidden fed in, draft hidden out, logits out). `inputs` (a list
    of (token, hidden) per step) replaces the fed-back values, so both sides can get the same ones.
    """
    out = ref(seq[None], output_hidden_states=True, return_shared_kv_states=True, use_cache=False)
    token, hidden = out.logits[:, -1:].argmax(-1), out.hidden_states[-1][:, -1:]
    position = torch.tensor([[len(seq)]])  # the generator's input_ids.shape[1] - 1: the last token's
    steps = []
    for i in range(STEPS):
        if inputs is not None:
            token, hidden = inputs[i]
        embeds = torch.cat([ref.get_input_embeddings()(token), hidden], dim=-1)
        draft = ref_draft(inputs_embeds=embeds, position_ids=position, shared_kv_states=out.shared_kv_states)
        steps.append((token[0, 0], hidden[0, 0], draft.last_hidden_state[0, 0], draft.logits[0, 0]))
        token, hidden = draft.logits.argmax(-1), draft.last_hidden_state
    return steps


@pytest.mark.parametrize(("target", "assistant"), PAIRS)
def test_draft_steps_match_transformers(pair, target, assistant):
    """Batch of 3 prompts (13 > window + 1, 6, 10), 4 steps at a constant position, same inputs on both sides."""
    ours, draft, ref, ref_draft = pair(target, assistant)
    seqs = prompts(13, 6, 10)
    refs = [reference_round(ref, ref_draft, seq) for seq in seqs]
    cache, hidden, token = prefill(ours, seqs)
    # Our target agrees on what the round starts from.
    assert token.tolist() == [r[0][0].item() for r in refs]
    torch.testing.assert_close(hidden, torch.stack([r[0][1] for r in refs]), **FP32)

    position = torch.tensor([len(s) for s in seqs])
    for i in range(STEPS):
        token = torch.stack([r[i][0] for r in refs])
        hidden = torch.stack([r[i][1] for r in refs])  # transformers' own fed-back state: errors don't compound
        with torch.inference_mode():
            draft_hidden, normed = draft(ours.embed(token[:, None])[:, 0], hidden, position, cache, ours.config)
            logits, greedy = draft.logits(normed), draft.greedy(normed)
        torch.testing.assert_close(draft_hidden, torch.stack([r[i][2] for r in refs]), **FP32)
        torch.testing.assert_close(logits, torch.stack([r[i][3] for r in refs]), **FP32)
        assert greedy.tolist() == [r[i][3].argmax().item() for r in refs]
        assert torch.equal(greedy, logits.argmax(-1))


@pytest.mark.parametrize(("target", "assistant"), PAIRS)
def test_first_round_of_assisted_generate(pair, target, assistant, monkeypatch):
    """transformers' own greedy assisted generate: its first drafted candidates and their logits are
    ours, each side feeding back its own outputs (step())."""
    ours, draft, ref, ref_draft = pair(target, assistant)
    rounds = []
    original = SinglePositionMultiTokenCandidateGenerator.get_candidates

    def recording(self, *args, **kwargs):
        ids, logits = original(self, *args, **kwargs)
        if logits is not None:
            rounds.append((ids, logits))
        return ids, logits

    monkeypatch.setattr(SinglePositionMultiTokenCandidateGenerator, "get_candidates", recording)
    seq = prompts(13, seed=1)[0]
    with torch.inference_mode():
        ref.generate(seq[None], assistant_model=ref_draft, max_new_tokens=8, do_sample=False)
    expected_ids, expected_logits = rounds[0]

    cache, hidden, token = prefill(ours, [seq])
    position = torch.tensor([len(seq)])
    got_ids, got_logits = [token], []
    with torch.inference_mode():
        for _ in range(STEPS):
            inputs = (ours.embed(token[:, None])[:, 0], hidden, position, cache, ours.config)
            got_logits.append(draft.logits(draft(*inputs)[1]))
            hidden, token = draft.step(*inputs)
            got_ids.append(token)
    assert torch.cat(got_ids).tolist() == expected_ids[0, len(seq):].tolist()
    torch.testing.assert_close(torch.stack(got_logits, 1), expected_logits.float(), **FP32)


@pytest.mark.parametrize(("target", "assistant"), PAIRS)
def test_slots_from_the_position_on_are_never_read(pair, target, assistant):
    """After a verify pass the cache holds rejected drafts at and after the next draft position;
    drafting there equals drafting from a cache that ends just before it (transformers on the prefix)."""
    ours, draft, ref, ref_draft = pair(target, assistant)
    seq = prompts(14, seed=6)[0]  # 11 accepted tokens, then 3 "rejected drafts" in the cache
    refs = reference_round(ref, ref_draft, seq[:11])
    cache, _, _ = prefill(ours, [seq])
    for token, hidden, expected_hidden, expected_logits in refs:
        with torch.inference_mode():
            got, normed = draft(ours.embed(token.view(1, 1))[:, 0], hidden[None], torch.tensor([11]), cache,
                                ours.config)
            logits = draft.logits(normed)
        torch.testing.assert_close(got[0], expected_hidden, **FP32)
        torch.testing.assert_close(logits[0], expected_logits, **FP32)


def test_draft_mask_keeps_window_plus_one_slots():
    mask = draft_mask(torch.tensor([13, 3]), 16, sliding_window=8)
    assert mask[0, 0, 0].nonzero().flatten().tolist() == list(range(4, 13))  # 9 slots, not its own
    assert mask[1, 0, 0].nonzero().flatten().tolist() == [0, 1, 2]
    assert draft_mask(torch.tensor([13]), 16)[0, 0, 0].nonzero().flatten().tolist() == list(range(13))


@pytest.mark.parametrize(("target", "assistant"), PAIRS)
def test_the_window_plus_one_matters(pair, target, assistant, monkeypatch):
    """The test has teeth: the target's own window (one slot fewer) moves the draft past the window."""
    ours, draft, ref, ref_draft = pair(target, assistant)
    seq = prompts(13, seed=2)[0]
    step = reference_round(ref, ref_draft, seq)[0]
    cache, _, _ = prefill(ours, [seq])
    real = assistant_module.draft_mask
    monkeypatch.setattr(assistant_module, "draft_mask", lambda p, n, w=None, kp=None: real(p, n, w - 1 if w else w, kp))
    with torch.inference_mode():
        got, _ = draft(ours.embed(step[0].view(1, 1))[:, 0], step[1][None], torch.tensor([13]), cache, ours.config)
    assert (got[0] - step[2]).abs().max() > 100 * FP32["atol"]


def test_centroid_greedy_and_masked_logits(pair):
    """On 64 random states: logits equal transformers' masked embedder row by row, the centroid
    greedy equals their argmax, and fill=-inf masks the same tokens."""
    _, draft, _, ref_draft = pair(*PAIRS[0])
    normed = torch.randn(64, draft.config.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        expected = torch.cat([ref_draft.masked_embedding(row[None, None], ref_draft.lm_head.weight)[0]
                              for row in normed])
        logits = draft.logits(normed)
        greedy = draft.greedy(normed)
        masked = draft.logits(normed, fill=float("-inf"))
    torch.testing.assert_close(logits, expected, **FP32)
    assert torch.equal(greedy, expected.argmax(-1))
    kept = masked.isfinite()
    per_row = draft.top_k * draft.config.vocab_size // draft.num_centroids
    assert kept.sum(-1).tolist() == [per_row] * 64
    assert torch.equal(masked[kept], logits[kept])
    assert (logits[~kept].view(64, -1) < logits[kept].view(64, -1).min(-1, keepdim=True).values).all()


@pytest.mark.parametrize(("target", "assistant"), PAIRS)
def test_bfloat16(pair, target, assistant):
    ours, draft, ref, ref_draft = pair(target, assistant, torch.bfloat16)
    seqs = prompts(13, 6, seed=4)
    refs = [reference_round(ref, ref_draft, seq) for seq in seqs]
    cache, _, _ = prefill(ours, seqs)
    position = torch.tensor([len(s) for s in seqs])
    for i in range(STEPS):
        token, hidden = torch.stack([r[i][0] for r in refs]), torch.stack([r[i][1] for r in refs])
        with torch.inference_mode():
            draft_hidden, normed = draft(ours.embed(token[:, None])[:, 0], hidden, position, cache, ours.config)
            logits = draft.logits(normed)
        torch.testing.assert_close(draft_hidden.float(), torch.stack([r[i][2] for r in refs]).float(), **BF16)
        torch.testing.assert_close(logits.float(), torch.stack([r[i][3] for r in refs]).float(), **BF16)


def test_producers_and_pair_checks(tiny):
    e2b = TextConfig.from_dict(_json(tiny("e2b_like")))
    dense = TextConfig.from_dict(_json(tiny("dense_31b_like")))
    # e2b_like: unshared S,S,F,S -> full from layer 2, not the last unshared layer; dense: no sharing.
    assert kv_producers_of(e2b) == {"sliding_attention": 3, "full_attention": 2}
    assert kv_producers_of(dense) == {"sliding_attention": 4, "full_attention": 5}
    centroids = Gemma4Assistant(_json(tiny("assistant_centroids")))
    assert centroids.check_target(e2b) == [3, 2]
    with pytest.raises(ValueError, match="backbone_hidden_size"):
        centroids.check_target(dense)


def test_config_refusals(tiny):
    config = _json(tiny("assistant_centroids"))
    with pytest.raises(ConfigError, match="target, not an assistant"):
        Gemma4Assistant(_json(tiny("e2b_like")))
    partly = {**config, "text_config": {**config["text_config"], "num_kv_shared_layers": 1}}
    with pytest.raises(ConfigError, match="every assistant layer must be KV-shared"):
        Gemma4Assistant(partly)
    ple = {**config, "text_config": {**config["text_config"], "hidden_size_per_layer_input": 8}}
    with pytest.raises(ConfigError, match="per-layer inputs"):
        Gemma4Assistant(ple)
    absent = {**config, "text_config": {k: v for k, v in config["text_config"].items() if k != "num_kv_shared_layers"}}
    assert Gemma4Assistant(absent).config.num_kv_shared_layers == 2  # transformers' default: all shared
    with pytest.raises(ConfigError, match="num_centroids"):
        Gemma4Assistant({**config, "num_centroids": 7})


def test_loader_is_strict(tiny):
    tensors = load_file(tiny("assistant_centroids") / "model.safetensors")
    model = Gemma4Assistant(_json(tiny("assistant_centroids")))
    load_assistant_state_dict(model, {**tensors, "lm_head.weight": tensors["model.embed_tokens.weight"]})
    assert torch.equal(model.lm_head.weight, tensors["model.embed_tokens.weight"].float())
    assert torch.equal(model.token_ordering, tensors["masked_embedding.token_ordering"])

    missing = {k: v for k, v in tensors.items() if k != "model.layers.1.self_attn.q_norm.weight"}
    with pytest.raises(ValueError, match=r"missing \['model.layers.1.self_attn.q_norm.weight'\]"):
        load_assistant_state_dict(model, missing)
    with pytest.raises(ValueError, match=r"unexpected \['model.layers.0.self_attn.k_proj.weight'\]"):
        load_assistant_state_dict(model, {**tensors, "model.layers.0.self_attn.k_proj.weight": torch.zeros(16, 32)})
    with pytest.raises(ValueError, match=r"pre_projection.weight \(32, 96\) \(expected \(32, 128\)\)"):
        load_assistant_state_dict(model, {**tensors, "pre_projection.weight": torch.zeros(32, 96)})
    with pytest.raises(ValueError, match="not a permutation"):
        load_assistant_state_dict(model, {**tensors, "masked_embedding.token_ordering": torch.zeros(128).long()})

    plain = Gemma4Assistant(_json(tiny("assistant_plain")))
    with pytest.raises(ValueError, match=r"unexpected \['masked_embedding.centroids.weight'"):
        load_assistant_state_dict(plain, tensors)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("target", "assistant"), PAIRS)
def test_cuda_runs_the_same_code(pair, target, assistant):
    ours, draft, ref, ref_draft = pair(target, assistant)
    seqs = prompts(13, 6, seed=5)
    refs = [reference_round(ref, ref_draft, seq) for seq in seqs]
    gpu_target = Gemma4TextModel(ours.config).cuda().eval()
    gpu_target.load_state_dict(ours.state_dict())
    gpu_draft = copy.deepcopy(draft).cuda()
    cache, _, _ = prefill(gpu_target, [s.cuda() for s in seqs])
    position = torch.tensor([len(s) for s in seqs], device="cuda")
    tol = {"atol": 1e-4, "rtol": 1e-4}  # CUDA BLAS sums in another order than the CPU
    for i in range(STEPS):
        token = torch.stack([r[i][0] for r in refs]).cuda()
        hidden = torch.stack([r[i][1] for r in refs]).cuda()
        with torch.inference_mode():
            draft_hidden, normed = gpu_draft(gpu_target.embed(token[:, None])[:, 0], hidden, position, cache,
                                             gpu_target.config)
            logits, greedy = gpu_draft.logits(normed), gpu_draft.greedy(normed)
        torch.testing.assert_close(draft_hidden.cpu(), torch.stack([r[i][2] for r in refs]), **tol)
        torch.testing.assert_close(logits.cpu(), torch.stack([r[i][3] for r in refs]), **tol)
        assert greedy.tolist() == [r[i][3].argmax().item() for r in refs]


def test_ordered_rows_give_what_the_scattered_rows_give(pair):
    """The contiguous centroid-ordered copy of lm_head (built at load) selects and scores the same tokens as
    gathering lm_head's rows by token_ordering, which transformers' masked embedder does."""
    _, draft, _, _ = pair(*PAIRS[0])
    normed = torch.randn(16, draft.config.hidden_size, generator=torch.Generator().manual_seed(4))
    assert draft.ordered_rows is not None
    with torch.inference_mode():
        fast_tokens, fast = draft._selected(normed)
        kept, draft.ordered_rows = draft.ordered_rows, None
        try:
            slow_tokens, slow = draft._selected(normed)
        finally:
            draft.ordered_rows = kept
    assert torch.equal(fast_tokens, slow_tokens)
    torch.testing.assert_close(fast, slow, rtol=0, atol=0)
