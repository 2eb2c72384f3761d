"""The shipped demo pair (mtpkit/demo): loads in transformers and in mtpkit, passes `check`, stays small, and
drafts well enough to show speculative decoding working.

The acceptance is oracle-backed: it is what our runtime's stats count, on held-out prompts, and the tokens are
checked equal to the target's own greedy decoding (so no draft could have been emitted unverified).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from mtpkit.demo import ASSISTANT, HELDOUT, TARGET, heldout_prompts

MAX_BYTES = 25 * 1024 * 1024
GOAL_FIRST_POSITION = 0.5  # greedy acceptance of the first draft, k = 4
GOAL_MEAN_LENGTH = 2.0  # tokens per target forward, k = 4
MAX_NEW_TOKENS = 64
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _config(folder) -> dict:
    return json.loads((folder / "config.json").read_text())


@pytest.fixture(scope="module")
def pair():
    import mtpkit

    return mtpkit.load_pair(target=TARGET, draft=ASSISTANT, dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    return heldout_prompts()


def test_size_and_files():
    demo = TARGET.parent
    total = sum(p.stat().st_size for p in demo.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    assert total <= MAX_BYTES, f"mtpkit/demo is {total / 2**20:.1f} MiB"
    for folder in (TARGET, ASSISTANT):
        for name in ("config.json", "generation_config.json", "model.safetensors", *TOKENIZER_FILES):
            assert (folder / name).is_file(), folder / name
    for name in TOKENIZER_FILES:  # the same tokenizer, byte for byte
        assert (TARGET / name).read_bytes() == (ASSISTANT / name).read_bytes(), name
    assert len(heldout_prompts()) >= 24 and HELDOUT.is_file()
    assert (demo / "TRAINING.md").is_file()


def test_configs_are_the_real_gemma4_layout():
    target, assistant = _config(TARGET), _config(ASSISTANT)
    assert target["model_type"] == "gemma4_text" and target["architectures"] == ["Gemma4ForCausalLM"]
    assert target["num_hidden_layers"] >= 6 and target["tie_word_embeddings"] is True
    assert {"sliding_attention", "full_attention"} == set(target["layer_types"])
    assert target["hidden_size_per_layer_input"] == 0
    assert assistant["model_type"] == "gemma4_assistant"
    assert assistant["architectures"] == ["Gemma4AssistantForCausalLM"]
    text = assistant["text_config"]
    assert text["num_kv_shared_layers"] == text["num_hidden_layers"]
    assert assistant["backbone_hidden_size"] == target["hidden_size"]
    assert assistant["use_ordered_embeddings"] is True
    assert text["vocab_size"] % assistant["num_centroids"] == 0
    for folder in (TARGET, ASSISTANT):
        generation = json.loads((folder / "generation_config.json").read_text())
        assert (generation["bos_token_id"], generation["eos_token_id"], generation["pad_token_id"]) == (2, 1, 0)
        with safe_open(folder / "model.safetensors", "pt") as f:
            dtypes = {f.get_slice(name).get_dtype() for name in f.keys()}
        assert dtypes <= {"BF16", "I64"}, dtypes  # I64: the assistant's token_ordering


def test_transformers_loads_the_pair():
    from transformers import AutoTokenizer, Gemma4ForCausalLM
    from transformers.models.gemma4_assistant import Gemma4AssistantForCausalLM

    target, info = Gemma4ForCausalLM.from_pretrained(TARGET, output_loading_info=True)
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assistant, info = Gemma4AssistantForCausalLM.from_pretrained(ASSISTANT, output_loading_info=True)
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    ordering = assistant.masked_embedding.token_ordering
    assert torch.equal(ordering.sort().values, torch.arange(ordering.numel()))
    tokenizer = AutoTokenizer.from_pretrained(TARGET)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (2, 1, 0)
    text = heldout_prompts()[0]
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text


def test_target_matches_transformers(pair, prompts):
    """Our runtime's target logits equal transformers' on the shipped weights (float32)."""
    from transformers import Gemma4ForCausalLM

    from mtpkit.runtime import KVCache

    ids = torch.tensor([pair.tokenizer(prompts[0])["input_ids"]])
    reference = Gemma4ForCausalLM.from_pretrained(TARGET, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.inference_mode():
        expected = reference(input_ids=ids).logits
        model, config = pair.target.model, pair.target.config
        hidden = model(ids, torch.arange(ids.shape[1])[None], KVCache(config, 1, ids.shape[1]))
        torch.testing.assert_close(model.logits(hidden), expected, atol=1e-4, rtol=1e-4)


def test_check_passes(cli):
    result = cli("check", "--target", TARGET, "--draft", ASSISTANT)
    assert result.code == 0, result.out + result.err
    assert "OK: 0 error(s), 0 warning(s)" in result.out


def test_speculative_output_equals_target_only(pair, prompts):
    alone = pair.generate(prompts[:2], max_new_tokens=MAX_NEW_TOKENS, num_speculative_tokens=0)
    drafted = pair.generate(prompts[:2], max_new_tokens=MAX_NEW_TOKENS, num_speculative_tokens=4)
    assert [g.token_ids for g in drafted] == [g.token_ids for g in alone]
    assert [g.text for g in drafted] == [g.text for g in alone]
    assert all(len(g.token_ids) > 0 for g in alone)


def test_acceptance_meets_the_goal(pair, prompts):
    alone = pair.generate(prompts[:4], max_new_tokens=MAX_NEW_TOKENS, num_speculative_tokens=0)
    drafted = pair.generate(prompts[:4], max_new_tokens=MAX_NEW_TOKENS, num_speculative_tokens=4)
    assert [g.token_ids for g in drafted] == [g.token_ids for g in alone]
    stats = drafted[0].stats
    assert stats.sequence_rounds > 0 and len(stats.acceptance_rate_per_position) == 4
    rates = stats.acceptance_rate_per_position
    assert rates[0] >= GOAL_FIRST_POSITION, rates
    assert stats.mean_acceptance_length >= GOAL_MEAN_LENGTH, (stats.mean_acceptance_length, rates)
    # Prefix acceptance: a later draft is accepted only after every earlier one.
    assert all(a >= b for a, b in zip(rates, rates[1:]))
