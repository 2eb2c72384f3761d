"""generate_greedy: target-only greedy against transformers' generate, speculative against target-only.

Greedy speculative decoding emits only the target's argmax tokens, so whatever the assistant drafts,
its output must equal target-only greedy decoding token for token; the drafts change only how many
target forwards it takes. Fake drafters with the assistant's interface pin acceptance to 100% and 0%.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import Gemma4ForCausalLM, Gemma4ForConditionalGeneration

from mtpkit.runtime import Gemma4Assistant, Gemma4TextModel, TextConfig, load_assistant_state_dict
from mtpkit.runtime import load_text_state_dict
from mtpkit.runtime.speculative import GenerationStats, generate_greedy

TARGETS = ["e2b_like", "moe_26b_like", "dense_31b_like", "multimodal", "text_only"]
PAIRS = [("e2b_like", "assistant_centroids"), ("dense_31b_like", "assistant_plain")]
LENGTHS = [13, 4, 21, 9]  # 13 and 21 pass the fixtures' sliding window (8)
NEW = 24


def _json(folder) -> dict:
    return json.loads((folder / "config.json").read_text())


@pytest.fixture(scope="module")
def load(tiny):
    """load(name, dtype) -> our target or assistant, loaded once per module."""
    loaded = {}

    def get(name: str, dtype: torch.dtype = torch.float32):
        if (name, dtype) not in loaded:
            config, tensors = _json(tiny(name)), load_file(tiny(name) / "model.safetensors")
            if name.startswith("assistant"):
                model = Gemma4Assistant(config).to(dtype).eval()
                load_assistant_state_dict(model, tensors)
            else:
                model = Gemma4TextModel(TextConfig.from_dict(config)).to(dtype).eval()
                load_text_state_dict(model, tensors)
            loaded[name, dtype] = model
        return loaded[name, dtype]

    return get


def prompts(*lengths: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 120, (n,), generator=g).tolist() for n in lengths]  # no pad/eos/bos/media


def run(target, prompts_, dtype=torch.float32, **kw) -> tuple[list[list[int]], GenerationStats]:
    kw.setdefault("max_new_tokens", NEW)
    return generate_greedy(target, target.config, prompts_, cache_dtype=dtype, **kw)


@pytest.fixture(scope="module")
def baseline(load):
    """baseline(target, dtype, max_new_tokens) -> target-only greedy outputs of prompts(*LENGTHS), batched."""
    done = {}

    def get(name: str, dtype: torch.dtype = torch.float32, new: int = NEW):
        if (name, dtype, new) not in done:
            done[name, dtype, new] = run(load(name, dtype), prompts(*LENGTHS), dtype, max_new_tokens=new)[0]
        return done[name, dtype, new]

    return get


# The tiny multimodal target generates its image / video / audio placeholder ids (120-126) from these
# prompts; transformers' wrapper embeds them as padding, and so must the runtime (TextConfig.media_token_ids).
@pytest.mark.parametrize("name", TARGETS)
def test_target_only_equals_transformers_generate(tiny, load, name):
    """Batch 1 per prompt on transformers' side (its padding changes numerics); ours batched too."""
    folder = tiny(name)
    cls = Gemma4ForConditionalGeneration if _json(folder)["model_type"] == "gemma4" else Gemma4ForCausalLM
    ref = cls.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager",
                              experts_implementation="eager").eval()
    target = load(name)
    seqs = prompts(13, 3, 20, seed=1)
    eos = target.config.eos_token_id  # transformers' generation_config stops on it too
    batched, _ = run(target, seqs, max_new_tokens=20, eos_token_ids=eos)
    for seq, got in zip(seqs, batched):
        with torch.inference_mode():
            expected = ref.generate(torch.tensor([seq]), do_sample=False, max_new_tokens=20)[0, len(seq):]
        assert got == expected.tolist()
        assert run(target, [seq], max_new_tokens=20, eos_token_ids=eos)[0][0] == got


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("k", range(1, 9))
@pytest.mark.parametrize(("target", "assistant"), PAIRS)
def test_speculative_equals_target_only(load, baseline, target, assistant, k, batch):
    seqs = prompts(*LENGTHS)[:batch]
    got, stats = run(load(target), seqs, assistant=load(assistant), num_speculative_tokens=k)
    assert got == baseline(target)[:batch]
    assert stats.num_speculative_tokens == k and len(stats.acceptance_rate_per_position) == k


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("k", range(1, 9))
@pytest.mark.parametrize(("target", "assistant"), PAIRS)
def test_speculative_equals_target_only_bfloat16(load, baseline, target, assistant, k, batch):
    """bf16 model and cache. Equality is not guaranteed in principle: the verify chunk (k + 1 tokens)
    and the one-token step run matmuls of other shapes, which may round differently and flip an
    argmax between two near-tied logits. It holds on these fixtures on CPU."""
    bf16 = torch.bfloat16
    seqs = prompts(*LENGTHS)[:batch]
    got, _ = run(load(target, bf16), seqs, bf16, assistant=load(assistant, bf16), num_speculative_tokens=k)
    assert got == baseline(target, bf16)[:batch]


def test_target_only_is_independent_of_the_batch(load, baseline):
    for name in ("e2b_like", "dense_31b_like"):
        alone = [run(load(name), [seq])[0][0] for seq in prompts(*LENGTHS)]
        assert alone == baseline(name)


class OracleDrafter:
    """The assistant's interface, drafting from known sequences: the truth, or the truth + `shift`.

    Draft step i of a round at position p proposes the token at p + i + 1; generate_greedy calls
    step exactly k times per round, which is how i is known.
    """

    def __init__(self, sequences: list[list[int]], k: int, shift: int = 0, vocab: int = 128):
        self.table = torch.tensor(sequences)
        self.k, self.shift, self.vocab, self.calls = k, shift, vocab, 0

    def step(self, token_embedding, hidden, position, target_cache, target_config):
        i = self.calls % self.k
        self.calls += 1
        token = self.table[torch.arange(len(position)), position + i + 1]
        return hidden, (token + self.shift) % self.vocab


def _oracle(load, baseline, name: str, k: int, shift: int = 0) -> OracleDrafter:
    # The truth must reach past the last round's drafts: NEW tokens + one chunk.
    seqs = prompts(*LENGTHS)
    width = max(LENGTHS) + NEW + k + 2
    full = [(s + out)[:width] for s, out in zip(seqs, baseline(name, new=NEW + k + 2))]
    return OracleDrafter([row + [0] * (width - len(row)) for row in full], k, shift)


@pytest.mark.parametrize("k", [1, 2, 5])
def test_perfect_drafter_is_always_accepted(load, baseline, k):
    name = "dense_31b_like"
    new = 1 + 3 * (k + 1)  # the prefill token, then 3 fully accepted rounds: no round is cut short
    got, stats = run(load(name), prompts(*LENGTHS), assistant=_oracle(load, baseline, name, k),
                     num_speculative_tokens=k, max_new_tokens=new)
    assert got == [out[:new] for out in baseline(name)]
    assert stats.rounds == 3 and stats.sequence_rounds == 3 * len(LENGTHS)
    assert stats.acceptance_rate_per_position == [1.0] * k
    assert stats.mean_acceptance_length == k + 1
    assert stats.accepted_lengths == [[k] * 3] * len(LENGTHS)
    assert stats.tokens_generated == new * len(LENGTHS)


@pytest.mark.parametrize("k", [1, 4])
def test_wrong_drafter_is_never_accepted(load, baseline, k):
    name = "e2b_like"
    got, stats = run(load(name), prompts(*LENGTHS), assistant=_oracle(load, baseline, name, k, shift=1),
                     num_speculative_tokens=k)
    assert got == baseline(name)
    assert stats.acceptance_rate_per_position == [0.0] * k and stats.mean_acceptance_length == 1.0
    assert stats.rounds == NEW - 1  # one token per target forward, as without drafts


@pytest.mark.parametrize("k", [2, 6])
@pytest.mark.parametrize(("target", "assistant"), PAIRS)
def test_stats_are_consistent(load, target, assistant, k):
    seqs = prompts(*LENGTHS, seed=3)
    outputs, stats = run(load(target), seqs, assistant=load(assistant), num_speculative_tokens=k, max_new_tokens=30)
    assert stats.tokens_generated == sum(map(len, outputs)) == 30 * len(seqs)
    assert stats.sequence_rounds == sum(map(len, stats.accepted_lengths))
    assert stats.rounds == max(map(len, stats.accepted_lengths))
    for out, lengths in zip(outputs, stats.accepted_lengths):
        # The prefill gives one token, each round accepted + 1; only the last round may be cut short.
        assert 1 + sum(a + 1 for a in lengths[:-1]) < len(out) <= 1 + sum(a + 1 for a in lengths)
        assert all(0 <= a <= k for a in lengths)
    rates = stats.acceptance_rate_per_position
    assert all(0.0 <= r <= 1.0 for r in rates)
    assert rates == sorted(rates, reverse=True)  # prefix acceptance: draft j needs drafts < j accepted
    assert stats.accepted_tokens == sum(map(sum, stats.accepted_lengths))
    assert 1.0 <= stats.mean_acceptance_length <= k + 1
    assert rates[0] < 0.5  # a random pair agrees rarely
    assert stats.draft_time > 0 and stats.verify_time > 0 and stats.tokens_per_second > 0


@pytest.mark.parametrize("k", [0, 3])
@pytest.mark.parametrize("kind", ["eos_token_ids", "stop_token_ids"])
def test_stops_per_sequence(load, baseline, kind, k):
    """Each row stops right after its own first stop token (kept in its output); the others run on."""
    name, assistant = PAIRS[0]
    full = baseline(name)
    stop = full[0][6]  # row 0 stops at its 7th token at the latest
    expected = [out[:out.index(stop) + 1] if stop in out else out for out in full]
    assert any(len(e) < NEW for e in expected) and any(len(e) == NEW for e in expected)
    got, stats = run(load(name), prompts(*LENGTHS), assistant=load(assistant) if k else None,
                     num_speculative_tokens=k, **{kind: [stop]})
    assert got == expected
    assert stats.tokens_generated == sum(map(len, expected))


def test_max_new_tokens_edges(load):
    target = load("text_only")
    assert run(target, prompts(5), max_new_tokens=0)[0] == [[]]
    one, stats = run(target, prompts(5, 9), max_new_tokens=1)
    assert list(map(len, one)) == [1, 1] and stats.rounds == 0
    with pytest.raises(ValueError, match="at least one token"):
        run(target, [[]])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("target", "assistant"), PAIRS)
def test_cuda_runs_the_same_code(load, baseline, target, assistant):
    gpu_target = copy.deepcopy(load(target)).cuda()
    gpu_draft = copy.deepcopy(load(assistant)).cuda()
    got, stats = run(gpu_target, prompts(*LENGTHS), assistant=gpu_draft, num_speculative_tokens=4)
    plain, _ = run(gpu_target, prompts(*LENGTHS))
    assert got == plain
    # CUDA's float32 matmuls sum in another order than the CPU's; a near-tie could flip a token.
    assert got == baseline(target)
    assert stats.draft_time > 0


class Recorder:
    """Wraps a drafter; keeps each round's (positions [B], drafts [B, k])."""

    def __init__(self, drafter, k: int):
        self.drafter, self.k, self.calls, self.rounds = drafter, k, 0, []

    def step(self, token_embedding, hidden, position, target_cache, target_config):
        hidden, token = self.drafter.step(token_embedding, hidden, position, target_cache, target_config)
        if self.calls % self.k == 0:
            self.rounds.append((position.clone(), []))
        self.rounds[-1][1].append(token)
        self.calls += 1
        return hidden, token


class FirstDraftTrue:
    """The assistant, except that each round's first draft is the truth, so every round accepts >= 1
    draft and the next round starts from a state after accepted drafts (random pairs rarely get one)."""

    def __init__(self, assistant, oracle: OracleDrafter):
        self.assistant, self.oracle = assistant, oracle

    def step(self, token_embedding, hidden, position, target_cache, target_config):
        first = self.oracle.calls % self.oracle.k == 0
        _, truth = self.oracle.step(token_embedding, hidden, position, target_cache, target_config)
        hidden, token = self.assistant.step(token_embedding, hidden, position, target_cache, target_config)
        return hidden, truth if first else token


@pytest.mark.parametrize("first_true", [False, True])
@pytest.mark.parametrize(("target", "assistant"), PAIRS)
def test_each_round_drafts_as_a_fresh_first_round(load, baseline, target, assistant, first_true):
    """The state carried between rounds (last token, hidden state of the token before it, position)
    is what a prefill of the text so far gives: each round's drafts equal the first round's drafts of
    a fresh generation from the sequence up to that round's position. The first round itself matches
    transformers (test_assistant.py::test_first_round_of_assisted_generate); later rounds of
    transformers' assisted generate cannot serve as the oracle: its drafter also attends the verify
    chunk's rejected drafts."""
    k, seqs = 3, prompts(*LENGTHS)
    full = [s + out for s, out in zip(seqs, baseline(target, new=NEW + k + 2))]
    width = max(map(len, full))
    table = [row + [0] * (width - len(row)) for row in full]

    def drafter(rows):
        return FirstDraftTrue(load(assistant), OracleDrafter(rows, k)) if first_true else load(assistant)

    recorder = Recorder(drafter(table), k)
    _, stats = run(load(target), seqs, assistant=recorder, num_speculative_tokens=k)
    if first_true:
        assert all(a >= 1 for lengths in stats.accepted_lengths for a in lengths)
    checked = 0
    for r, (position, drafts) in enumerate(recorder.rounds):
        for b, seq in enumerate(full):
            if r >= len(stats.accepted_lengths[b]):
                continue  # row b had finished
            p = int(position[b])
            fresh = Recorder(drafter([table[b]]), k)
            run(load(target), [seq[:p]], assistant=fresh, num_speculative_tokens=k, max_new_tokens=2)
            assert int(fresh.rounds[0][0][0]) == p
            assert [int(d[b]) for d in drafts] == [int(d[0]) for d in fresh.rounds[0][1]], (r, b)
            checked += 1
    assert checked == stats.sequence_rounds
