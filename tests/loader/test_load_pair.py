"""load_pair on a pair with a tokenizer: pair folder vs target= / draft=, text in and out, stop, stream, describe.

Oracles: the `tokenizers` library reading tokenizer.json directly (not transformers, which the loader uses) for
encoding and decoding; the pair's own token-id generation for what a text prompt, a stop entry or a stream must
reproduce; `formats.gemma4.kv_producers` on the target's config.json (not the runtime's TextConfig) for the KV map.
"""

from __future__ import annotations

import json

import pytest
import torch
from tokenizers import Tokenizer

from mtpkit.formats.gemma4 import kv_producers
from mtpkit.loader import load_pair
from mtpkit.loader.memory import model_bytes
from tests.fixtures.tokenizer import LETTERS

PROMPTS = [[5, 17, 33, 2, 99, 64, 7, 8, 120, 3, 44, 45, 9], [7, 8, 9, 10, 11]]
TEXT = "hello world"
NEW = 16


@pytest.fixture(scope="module")
def folders(tokenized_pair):
    return tokenized_pair


@pytest.fixture(scope="module")
def pair(folders):
    return load_pair(target=folders["target"], draft=folders["draft"], dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def raw(folders):
    return Tokenizer.from_file(str(folders["target"] / "tokenizer.json"))


def _tokens(generations):
    return [g.token_ids for g in generations]


def test_pair_folder_and_target_draft_give_the_same_outputs(folders, pair):
    from_folder = load_pair(folders["pair"], dtype="float32", device="cpu")
    assert from_folder.target.checkpoint.folder == folders["pair"] / "target"
    assert from_folder.draft.checkpoint.folder == folders["pair"] / "draft"
    for kw in (dict(num_speculative_tokens=3), dict(num_speculative_tokens=2, temperature=0.8, top_p=0.9, seed=7)):
        ours = pair.generate(PROMPTS, max_new_tokens=NEW, **kw)
        theirs = from_folder.generate(PROMPTS, max_new_tokens=NEW, **kw)
        assert _tokens(ours) == _tokens(theirs)
        assert [g.accepted_lengths for g in ours] == [g.accepted_lengths for g in theirs]
    # Greedy speculative output is the target's own greedy output.
    assert _tokens(from_folder.generate(PROMPTS, max_new_tokens=NEW, num_speculative_tokens=3)) == \
        _tokens(pair.generate(PROMPTS, max_new_tokens=NEW, num_speculative_tokens=0))
    # A text prompt goes through the pair folder's copy of the tokenizer alike.
    assert from_folder.tokenizer is not None
    assert from_folder.generate(TEXT, max_new_tokens=NEW)[0].text == pair.generate(TEXT, max_new_tokens=NEW)[0].text


def test_text_prompts_are_encoded_and_outputs_decoded_by_the_tokenizer(pair, raw):
    texts = [TEXT, "abc"]
    results = pair.generate(texts, max_new_tokens=NEW, num_speculative_tokens=2)
    by_ids = pair.generate([raw.encode(t).ids for t in texts], max_new_tokens=NEW, num_speculative_tokens=2)
    for text, result, expected in zip(texts, results, by_ids):
        assert result.prompt_token_ids == raw.encode(text).ids == [LETTERS.get(c, 36) for c in text]
        assert result.token_ids == expected.token_ids and result.token_ids
        assert result.text == raw.decode(result.token_ids) == expected.text  # special tokens skipped
        assert raw.decode(result.prompt_token_ids) == text  # the tokenizer round-trips: decoding is meaningful
        assert result.text  # generated tokens with visible text, not only specials


def test_stop_token_id_stops_right_after_it(pair):
    for k in (0, 3):  # 3: the stop token can land inside an accepted round
        base = pair.generate(PROMPTS, max_new_tokens=NEW, num_speculative_tokens=k)
        stop = base[0].token_ids[4]
        assert stop != 1  # not the EOS (which stops anyway)
        stopped = pair.generate(PROMPTS, max_new_tokens=NEW, num_speculative_tokens=k, stop=[stop])
        for b, s in zip(base, stopped):
            cut = b.token_ids.index(stop) + 1 if stop in b.token_ids else len(b.token_ids)
            assert s.token_ids == b.token_ids[:cut]
        assert stopped[0].token_ids[-1] == stop and len(stopped[0].token_ids) <= 5


def test_stop_strings(pair, raw):
    base = pair.generate(TEXT, max_new_tokens=NEW, num_speculative_tokens=2)[0]
    # A one-token string is that token id.
    letter_ids = {v: c for c, v in LETTERS.items()}
    letter = next(letter_ids[t] for t in base.token_ids if t in letter_ids)
    by_string = pair.generate(TEXT, max_new_tokens=NEW, num_speculative_tokens=2, stop=letter)[0]
    assert by_string.token_ids == pair.generate(TEXT, max_new_tokens=NEW, num_speculative_tokens=2,
                                                stop=LETTERS[letter])[0].token_ids
    assert by_string.token_ids[-1] == LETTERS[letter]
    # A longer string cuts the text at its first occurrence and keeps the tokens whose text lies before it.
    visible = [t for t in base.token_ids if raw.decode([t])]
    stop = raw.decode(visible[3:5])
    assert len(stop) > 1 and stop in base.text
    cut = pair.generate(TEXT, max_new_tokens=NEW, num_speculative_tokens=2, stop=["zzzz-never", stop])[0]
    expected = base.text[:base.text.index(stop)]
    assert cut.text == expected
    keep = max(n for n in range(len(base.token_ids) + 1) if expected.startswith(raw.decode(base.token_ids[:n])))
    assert cut.token_ids == base.token_ids[:keep]


@pytest.mark.parametrize("kw", [dict(num_speculative_tokens=3), dict(num_speculative_tokens=0),
                                dict(num_speculative_tokens=2, temperature=0.9, top_k=40, seed=5)],
                         ids=["greedy-k3", "target-only", "sampled"])
def test_stream_concatenates_to_generate_text(pair, kw):
    expected = pair.generate(TEXT, max_new_tokens=NEW, **kw)[0].text
    pieces = list(pair.stream(TEXT, max_new_tokens=NEW, **kw))
    assert "".join(pieces) == expected and expected
    assert len(pieces) > 1 and all(pieces)  # streamed as rounds are accepted, not at the end


def test_stream_honours_a_stop_string(pair):
    base = pair.generate(TEXT, max_new_tokens=NEW, num_speculative_tokens=2)[0].text
    stop = base[len(base) // 2:len(base) // 2 + 2]
    expected = pair.generate(TEXT, max_new_tokens=NEW, num_speculative_tokens=2, stop=stop)[0].text
    assert "".join(pair.stream(TEXT, max_new_tokens=NEW, num_speculative_tokens=2, stop=stop)) == expected
    assert stop not in expected and len(expected) < len(base)


def test_describe(folders, pair):
    summary = pair.describe()
    json.dumps(summary)  # plain JSON
    target_config = json.loads((folders["target"] / "config.json").read_text())
    draft_config = json.loads((folders["draft"] / "config.json").read_text())
    producers = kv_producers(target_config)
    assert summary["kv_map"] == {f"draft layer {i}": f"target layer {producers[t]} ({t})"
                                 for i, t in enumerate(draft_config["text_config"]["layer_types"])}
    # e2b_like: the full-attention producer is layer 2, not the last unshared layer (3, sliding).
    assert summary["kv_map"] == {"draft layer 0": "target layer 3 (sliding_attention)",
                                 "draft layer 1": "target layer 2 (full_attention)"}
    assert summary["tokenizer"] is True and summary["draft"]["centroids"] is True
    assert summary["device"] == "cpu" and summary["dtype"] == "float32"
    assert summary["kv_cache"] == {"dtype": "float32", "scales": None}
    assert summary["target"]["quantization"] is None
    assert summary["target"]["bytes_loaded"] == model_bytes(pair.target.checkpoint, torch.float32)
    assert summary["num_speculative_tokens"]["value"] == 4  # no published setting for this size: the default
