"""A corpus of broken assistants, each drafted by `mtp-convert draft SRC OUT` and judged by transformers.

Every case in `draft_corpus_cases.py` damages a private copy of a tiny assistant in one way. For a repaired
case the oracles are independent of mtpkit:
- transformers' AutoConfig loads OUT as Gemma4AssistantConfig, and the loaded config (per-layer head dims
  included) equals that of the clean original loaded the same way;
- Gemma4AssistantForCausalLM loads OUT with no missing/unexpected keys, and its logits on seeded inputs
  shaped as transformers' SinglePositionMultiTokenCandidateGenerator builds them equal the clean original's;
- safetensors reads OUT's tensors bit-identical to the input's (pure config fixes), to the clean BF16
  original (an FP32 copy cast back), or to torch's own cast (--dtype float16);
- OUT carries no quantization keys and no hf_quant_config.json; `mtp-convert check` with the matching
  target exits 0; every config path that changed is recorded in OUT/mtpkit_draft.json and printed;
  a second `draft` gives a byte-identical tree and applies no rule.
The same corpus drafted with --dialect per-layer must spell per_layer_config as transformers' save_pretrained does.
Cases draft cannot repair are refused: by `draft` itself (exit 2, one line), or by `check` with its id.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig
from transformers.models.gemma4_assistant import Gemma4AssistantConfig, Gemma4AssistantForCausalLM

from tests.conftest import tree_digest
from tests.convert.draft_corpus_cases import (
    ASSISTANT_KEYS, CENTROIDS, PLAIN, QUANT_KEYS, REPAIRED, TARGET_OF, UNFIXABLE, WEIGHTS, Case, _eleven_layers,
    every_tensor_fp32, grown_vocab, read_config, write_config,
)

REPORT = "mtpkit_draft.json"
INVARIANTS = {"hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0, "enable_moe_block": False,
              "use_double_wide_mlp": False}
KV_LEN = 6  # target positions already in the shared cache (below the tiny sliding window of 8)


# ----------------------------------------------------------------------------------------------- oracles


def head_dims(folder: Path) -> list[tuple[int, int]]:
    """Per-layer (head_dim, num_key_value_heads) as transformers resolves them from config.json."""
    config = AutoConfig.from_pretrained(folder)
    assert isinstance(config, Gemma4AssistantConfig)
    text = config.text_config
    return [(text.per_layer_config[i].head_dim, text.per_layer_config[i].num_key_value_heads)
            for i in range(text.num_hidden_layers)]


def loaded_config(folder: Path) -> dict:
    """transformers' view of the config (what it reads), minus fields that name the folder or the weights' dtype."""
    config = AutoConfig.from_pretrained(folder).to_dict()
    for key in ("_name_or_path", "dtype", "transformers_version"):
        config.pop(key, None)
        config["text_config"].pop(key, None)
    return config


def assistant_inputs(folder: Path) -> dict:
    """Seeded inputs shaped as transformers' candidate generator builds them: inputs_embeds = concat(target token
    embedding, target last hidden state) of width 2*backbone_hidden_size, one position, and the target's K/V of
    the last layer of each attention type as (batch, kv_heads, kv_len, head_dim)."""
    config = AutoConfig.from_pretrained(folder)
    text = config.text_config
    generator = torch.Generator().manual_seed(1234)
    shared = {}
    for i, layer_type in enumerate(text.layer_types):
        geometry = text.per_layer_config[i]
        shape = (1, geometry.num_key_value_heads, KV_LEN, geometry.head_dim)
        shared[layer_type] = (torch.randn(shape, generator=generator), torch.randn(shape, generator=generator))
    return {"inputs_embeds": torch.randn(1, 1, 2 * config.backbone_hidden_size, generator=generator),
            "position_ids": torch.tensor([[KV_LEN]]), "shared_kv_states": shared}


def run_assistant(folder: Path, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    model, info = Gemma4AssistantForCausalLM.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not info["mismatched_keys"], info
    model.eval()
    with torch.no_grad():
        out = model(**inputs, use_cache=False)
    return out.logits, out.last_hidden_state


def tensors_of(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / WEIGHTS)


def assert_same_tensors(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(actual) == sorted(expected)
    for name, tensor in expected.items():
        assert actual[name].dtype == tensor.dtype, name
        assert actual[name].shape == tensor.shape, name
        assert torch.equal(actual[name].view(torch.uint8), tensor.view(torch.uint8)), name


def config_paths(config: dict) -> dict[str, object]:
    """{"key": value, "text_config.key": value} for both levels of a config."""
    paths = {k: v for k, v in config.items() if k != "text_config"}
    text = config.get("text_config")
    if isinstance(text, dict):
        paths |= {f"text_config.{k}": v for k, v in text.items()}
    return paths


def assert_canonical(out: Path) -> dict:
    """The form the spec requires of every draft output (flat dialect)."""
    from transformers import Gemma4TextConfig

    config = read_config(out)
    text = config["text_config"]
    assert config["model_type"] == "gemma4_assistant"
    assert config["architectures"] == ["Gemma4AssistantForCausalLM"]
    assert text["model_type"] == "gemma4_text"
    assert text["num_kv_shared_layers"] == text["num_hidden_layers"]
    assert {k: text[k] for k in INVARIANTS} == INVARIANTS
    for key in QUANT_KEYS:
        assert key not in config and key not in text, key
    assert not (out / "hf_quant_config.json").exists()
    # Architecture fields of transformers' Gemma4TextConfig live in text_config, not at the top level.
    own = set(Gemma4AssistantConfig.__annotations__) | {"dtype", "architectures", "transformers_version", "model_type"}
    stray = (set(Gemma4TextConfig.__annotations__) - own) & set(config)
    assert not stray, stray
    # ...and assistant fields at the top level, not in text_config.
    assert not set(ASSISTANT_KEYS) & set(text)
    return config


# ----------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def clean_logits(tiny):
    cache: dict[Path, tuple] = {}

    def get(folder: Path) -> tuple:
        if folder not in cache:
            inputs = assistant_inputs(folder)
            cache[folder] = (inputs, run_assistant(folder, inputs))
        return cache[folder]

    return get


def draft_ok(cli, src: Path, out: Path, *args: str) -> str:
    result = cli("draft", src, out, *args)
    assert result.code == 0, result.err
    return result.out


# ----------------------------------------------------------------------------------------------- repaired cases


@pytest.mark.parametrize("case", REPAIRED, ids=[c.id for c in REPAIRED])
def test_repaired(case: Case, tiny, tiny_copy, tmp_path, cli, clean_logits):
    src = tiny_copy(case.base)
    case.edit(src)
    before_config, before_tensors, before_tree = read_config(src), tensors_of(src), tree_digest(src)
    reference = src if case.reference == "input" else tiny(case.base)
    out = tmp_path / "out"

    printed = draft_ok(cli, src, out, *case.args)
    assert tree_digest(src) == before_tree  # the input is never touched

    # The form, and the values the case fixes.
    config = assert_canonical(out)
    assert "global_head_dim" in config["text_config"] and "per_layer_config" not in config["text_config"]
    paths = config_paths(config)
    for path, value in case.expect.items():
        assert paths.get(path, "absent") == value, path

    # transformers reads OUT exactly as it reads the clean original.
    assert head_dims(out) == head_dims(reference)
    assert loaded_config(out) == loaded_config(reference)

    # Tensors: bytes unchanged for a config fix; a cast is torch's own cast of the reference (an FP32 copy of BF16
    # weights cast back to BF16 is the BF16 original, bit for bit).
    after_tensors = tensors_of(out)
    expected = {k: v.to(case.out_dtype) if v.is_floating_point() else v for k, v in tensors_of(reference).items()}
    assert_same_tensors(after_tensors, expected)
    if "cast-dtype" not in case.rules:
        assert_same_tensors(after_tensors, before_tensors)
    if case.base == CENTROIDS:
        assert after_tensors["masked_embedding.token_ordering"].dtype == torch.int64

    # Same model: logits and projected state equal the clean original's on the same inputs.
    inputs, (logits, hidden) = clean_logits(reference)
    out_logits, out_hidden = run_assistant(out, inputs)
    if case.same_model:
        assert torch.equal(out_logits, logits) and torch.equal(out_hidden, hidden)
    else:  # a lossy cast of the weights: the same model up to rounding
        assert torch.allclose(out_logits, logits, rtol=1e-4, atol=1e-5)

    # The rules: the expected ones recorded; every changed config path recorded and printed.
    report = json.loads((out / REPORT).read_text())
    recorded = report["rules"]
    assert set(case.rules) <= {r["rule"] for r in recorded}, [r["rule"] for r in recorded]
    recorded_paths = {r["path"] for r in recorded}
    old = config_paths(before_config)
    for path in sorted(set(paths) | set(old)):
        if old.get(path, "absent") != paths.get(path, "absent"):
            moved = path.startswith("text_config.") and path.removeprefix("text_config.") in recorded_paths
            assert path in recorded_paths or moved, f"{path} changed but is not recorded"
    for rule in recorded:
        assert f"[{rule['rule']}] {rule['path']}:" in printed
    assert f"{len(recorded)} rule(s) applied" in printed

    # The pair is accepted.
    check = cli("check", "--target", tiny(TARGET_OF[case.base]), "--draft", out)
    assert check.code == 0, check.out + check.err

    # Idempotent: draft(draft(x)) is byte-identical and applies nothing.
    again = tmp_path / "again"
    printed_again = draft_ok(cli, out, again, *case.args)
    assert tree_digest(again) == tree_digest(out)
    assert "no rule applied" in printed_again and "[" not in printed_again.split("wrote")[0]


# ----------------------------------------------------------------------------------------------- --dialect per-layer


def _transformers_per_layer(folder: Path, tmp: Path) -> dict:
    """The per_layer_config transformers itself writes when it re-saves `folder`'s config."""
    Gemma4AssistantConfig.from_pretrained(folder).save_pretrained(tmp)
    return read_config(tmp)["text_config"]["per_layer_config"]


def _global_kv_equal(src: Path) -> None:
    """Global KV heads equal to the sliding ones: transformers then writes no num_key_value_heads override."""
    config = read_config(src)
    config["text_config"]["num_global_key_value_heads"] = 2
    config["text_config"]["per_layer_config"]["1"]["num_key_value_heads"] = 2
    write_config(src, config)


@pytest.mark.parametrize("base", [PLAIN, CENTROIDS, "eleven-layers", "global-kv-equal"])
def test_per_layer_dialect(base, tiny, tiny_copy, tmp_path, cli, clean_logits):
    target = TARGET_OF[PLAIN]  # for the variants built from assistant_plain
    if base == "eleven-layers":
        src = tiny_copy(PLAIN)
        _eleven_layers(src)
    elif base == "global-kv-equal":
        src = tiny_copy(PLAIN)
        _global_kv_equal(src)
        target = None  # 2 global KV heads no longer fit dense_31b_like (1): `check` rightly refuses the pair
    else:
        src, target = tiny(base), TARGET_OF[base]
    expected = _transformers_per_layer(src, tmp_path / "saved")
    if base == "eleven-layers":
        assert list(expected) == ["01", "10"]  # the oracle really zero-pads here
    out = tmp_path / "out"
    draft_ok(cli, src, out, "--dialect", "per-layer")

    text = read_config(out)["text_config"]
    assert text["per_layer_config"] == expected
    assert list(text["per_layer_config"]) == list(expected)
    assert "global_head_dim" not in text and "num_global_key_value_heads" not in text
    assert head_dims(out) == head_dims(src)
    assert loaded_config(out) == loaded_config(src)
    inputs, (logits, _) = clean_logits(src)
    assert torch.equal(run_assistant(out, inputs)[0], logits)
    assert_same_tensors(tensors_of(out), tensors_of(src))

    if target is not None:
        check = cli("check", "--target", tiny(target), "--draft", out)
        assert check.code == 0, check.out + check.err
    again = tmp_path / "again"
    assert "no rule applied" in draft_ok(cli, out, again, "--dialect", "per-layer")
    assert tree_digest(again) == tree_digest(out)


@pytest.mark.parametrize("case", REPAIRED, ids=[c.id for c in REPAIRED])
def test_repaired_per_layer(case: Case, tiny, tiny_copy, tmp_path, cli, clean_logits):
    """Every repairable case, drafted with --dialect per-layer: transformers' own spelling, the same model."""
    src = tiny_copy(case.base)
    case.edit(src)
    reference = src if case.reference == "input" else tiny(case.base)
    out = tmp_path / "out"
    draft_ok(cli, src, out, "--dialect", "per-layer", *case.args)
    text = read_config(out)["text_config"]
    assert text["per_layer_config"] == _transformers_per_layer(reference, tmp_path / "saved")
    assert "global_head_dim" not in text and "num_global_key_value_heads" not in text
    assert head_dims(out) == head_dims(reference) and loaded_config(out) == loaded_config(reference)
    if case.same_model:
        inputs, (logits, _) = clean_logits(reference)
        assert torch.equal(run_assistant(out, inputs)[0], logits)
    check = cli("check", "--target", tiny(TARGET_OF[case.base]), "--draft", out)
    assert check.code == 0, check.out + check.err
    again = tmp_path / "again"
    assert "no rule applied" in draft_ok(cli, out, again, "--dialect", "per-layer", *case.args)
    assert tree_digest(again) == tree_digest(out)


# ----------------------------------------------------------------------------------------------- refused cases


@pytest.mark.parametrize("case", UNFIXABLE, ids=[c.id for c in UNFIXABLE])
def test_unfixable(case, tiny, tiny_copy, tmp_path, cli):
    src = tiny_copy(case.base)
    case.edit(src)
    before = tree_digest(src)
    out = tmp_path / "out"
    result = cli("draft", src, out)
    if case.check_id is None:
        assert result.code == 2, result.out + result.err
        lines = result.err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("mtp-convert: error: "), result.err
        assert case.message in lines[0] and str(src / WEIGHTS) in lines[0]
        assert result.out == ""
        assert sorted(p.name for p in tmp_path.iterdir()) == [src.name]  # no OUT, no temporary folder beside it
        assert tree_digest(src) == before
        return
    assert result.code == 0, result.err
    check = cli("check", "--target", tiny(TARGET_OF[case.base]), "--draft", out)
    assert check.code == 1, check.out + check.err
    assert f"error [{case.check_id}]" in check.out
    # The oracle agrees the pair is broken: transformers reads different vocab sizes / a non-permutation.
    if case.check_id == "vocab-size":
        ours = AutoConfig.from_pretrained(out).text_config.vocab_size
        assert ours == tensors_of(src)["model.embed_tokens.weight"].shape[0] != AutoConfig.from_pretrained(
            tiny(TARGET_OF[case.base])).get_text_config().vocab_size
    else:
        ordering = tensors_of(out)["masked_embedding.token_ordering"]
        assert not torch.equal(ordering.sort().values, torch.arange(ordering.numel()))


# ----------------------------------------------------------------------------------------------- token_ordering dtype


def test_float_token_ordering_is_not_rounded(tiny_copy, tmp_path, cli):
    """Every tensor of a 512-token assistant stored as float32, token_ordering included: the BF16 draft must keep
    the token ids exact (BF16 holds integers exactly only up to 256). Oracle: the sound int64/BF16 model it was
    made from, as transformers runs it. (Failed before ff7b39a: token_ordering was cast to BF16 like a weight.)"""
    reference = tiny_copy(CENTROIDS)
    grown_vocab(reference)
    src = tmp_path / "fp32"
    shutil.copytree(reference, src)
    every_tensor_fp32(src)
    permutation = tensors_of(reference)["masked_embedding.token_ordering"]
    # Both inputs are sound: transformers reads the same permutation from each, and the reference runs.
    for folder in (reference, src):
        model = Gemma4AssistantForCausalLM.from_pretrained(folder, dtype=torch.float32)
        assert torch.equal(model.masked_embedding.token_ordering.long(), permutation)
    inputs = assistant_inputs(reference)
    logits, _ = run_assistant(reference, inputs)
    out = tmp_path / "out"
    draft_ok(cli, src, out)
    assert torch.equal(tensors_of(out)["masked_embedding.token_ordering"].long(), permutation)
    assert torch.equal(run_assistant(out, inputs)[0], logits)
