"""load_pair on every format `mtp-convert quantize` writes, against oracles that do not go through the loader.

(a) The loaded target's logits equal those of transformers' Gemma4ForCausalLM built from the BF16 source in
    float32 with each quantized weight replaced by `dequantize_weight` of the tensors written to disk (the
    runtime is weight-only: activation scales are not applied, so this is the exact reference), and it runs the
    weights as stored (one QuantizedLinear per quantized module). Without an FP8 KV cache, target-only greedy
    decoding equals transformers' greedy `generate` on that reference too.
(b) Greedy speculative decoding (k = 2, 4) emits exactly the target-only greedy tokens, batched.
(c) `--kv-cache fp8`: the pair runs an FP8 cache whose scales are the checkpoint's k_scale / v_scale tensors,
    read back with safetensors; without it the cache is in the compute dtype and has no scales.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import Gemma4ForCausalLM

from mtpkit.cli.app import main
from mtpkit.formats.dequantize import dequantize_weight, plan_modules
from mtpkit.loader import Pair, load_pair
from mtpkit.runtime import KVCache, QuantizedLinear
from tests.fixtures.gemma4_tiny import _assistant, _save, _text_config

# case: (target fixture, scheme, format, --kv-cache fp8). Calibrated schemes carry the FP8 KV cache too.
CASES = {
    "ct-fp8-dynamic": ("dense_31b_like", "fp8-dynamic", "compressed-tensors", False),
    "ct-fp8": ("dense_31b_like", "fp8", "compressed-tensors", True),
    "ct-fp8-block": ("wide", "fp8-block", "compressed-tensors", False),
    "ct-nvfp4": ("dense_31b_like", "nvfp4", "compressed-tensors", True),
    "ct-nvfp4a16": ("dense_31b_like", "nvfp4a16", "compressed-tensors", False),
    "modelopt-fp8": ("dense_31b_like", "fp8", "modelopt", True),
    "modelopt-nvfp4": ("dense_31b_like", "nvfp4", "modelopt", True),
}
DRAFT = {"dense_31b_like": "assistant_plain", "wide": "wide_assistant"}
IDS = [5, 17, 33, 2, 99, 64, 7, 8, 120, 3, 44, 45, 9]  # 13 tokens: past the sliding window (8)
PROMPTS = [IDS, [7, 8, 9, 10, 11]]  # a batch of two lengths
NEW = 16


@pytest.fixture(scope="module")
def models(tiny, tmp_path_factory):
    """models(name): the tiny fixtures plus `wide` (dims multiples of 128, as fp8-block needs) and its assistant."""
    root = tmp_path_factory.mktemp("wide")
    built = {}

    def get(name: str):
        if name == "wide" and name not in built:
            torch.manual_seed(0)
            config = _text_config(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                                  num_key_value_heads=2, head_dim=64, global_head_dim=128,
                                  layer_types=["sliding_attention", "full_attention"])
            built[name] = _save(Gemma4ForCausalLM(config), root / "wide")
        elif name == "wide_assistant" and name not in built:
            built[name] = _assistant(root / "wide_assistant", backbone_hidden_size=128, use_ordered_embeddings=False,
                                     head_dim=64, global_head_dim=128)
        return built.get(name) or tiny(name)

    return get


@pytest.fixture(scope="module")
def calib(tmp_path_factory):
    g = torch.Generator().manual_seed(3)
    path = tmp_path_factory.mktemp("calib") / "calib.jsonl"
    path.write_text("".join(json.dumps({"input_ids": torch.randint(3, 120, (n,), generator=g).tolist()}) + "\n"
                            for n in (7, 5, 6, 7)))
    return path


@pytest.fixture(scope="module")
def quantized(models, calib, tmp_path_factory):
    """quantized(case) -> the folder `mtp-convert quantize` wrote (built once per module)."""
    built = {}

    def get(case: str):
        if case not in built:
            name, scheme, fmt, kv = CASES[case]
            out = tmp_path_factory.mktemp("q") / case
            args = ["quantize", str(models(name)), str(out), "--scheme", scheme, "--format", fmt, "--no-evaluate"]
            if scheme in ("fp8", "nvfp4") or kv:
                args += ["--calib", str(calib)]
            if kv:
                args += ["--kv-cache", "fp8"]
            try:
                main(args)
            except SystemExit as e:
                assert e.code in (0, None), args
            built[case] = out
        return built[case]

    return get


@pytest.fixture(scope="module")
def pairs(models, quantized):
    loaded = {}

    def get(case: str) -> Pair:
        if case not in loaded:
            name = CASES[case][0]
            loaded[case] = load_pair(target=quantized(case), draft=models(DRAFT[name]), dtype="float32", device="cpu")
        return loaded[case]

    return get


@pytest.fixture(scope="module")
def reference(models):
    """reference(case_folder, name) -> transformers' model of the BF16 source in float32, with each quantized
    weight replaced by dequantize_weight of the written tensors (one model per source, re-patched per case)."""
    sources = {}

    def get(folder, name: str):
        if name not in sources:
            model = Gemma4ForCausalLM.from_pretrained(models(name), dtype=torch.float32,
                                                      attn_implementation="eager").eval()
            sources[name] = (model, {k: v.clone() for k, v in model.state_dict().items()})
        model, original = sources[name]
        model.load_state_dict(original)
        tensors = load_file(folder / "model.safetensors")
        state = model.state_dict()
        quantized = [plan for plan in plan_modules(tensors).values() if plan.quantized]
        with torch.no_grad():
            for plan in quantized:
                stored = {suffix: tensors[full] for suffix, full in plan.sources.items()}
                state[plan.weight_name].copy_(dequantize_weight(stored, torch.float32, name=plan.prefix))
        return model, len(quantized), original

    return get


@torch.inference_mode()
def _runtime_logits(pair: Pair, ids: list[int]) -> torch.Tensor:
    model = pair.target.model
    tokens = torch.tensor([ids])
    positions = torch.arange(len(ids))[None]
    return model.logits(model(tokens, positions, KVCache(pair.target.config, 1, len(ids))))[0]


@pytest.mark.parametrize("case", CASES)
def test_logits_equal_the_dequantized_transformers_reference(pairs, quantized, reference, case):
    name = CASES[case][0]
    pair = pairs(case)
    model, count, original = reference(quantized(case), name)
    assert count > 0
    # Run as stored: every quantized module is a QuantizedLinear, nothing was densified at load.
    assert sum(isinstance(m, QuantizedLinear) for m in pair.target.model.modules()) == count
    assert pair.target.dtype == torch.float32 and pair.describe()["target"]["quantization"]["scheme"] == CASES[case][1]
    ours = [_runtime_logits(pair, ids) for ids in PROMPTS]
    for ids, logits in zip(PROMPTS, ours):
        with torch.inference_mode():
            theirs = model(input_ids=torch.tensor([ids])).logits[0]
        torch.testing.assert_close(logits, theirs, rtol=1e-5, atol=1e-5)
    if not CASES[case][3]:  # a float32 cache: greedy decoding itself must agree with transformers'
        target_only = pair.generate(PROMPTS, max_new_tokens=NEW, num_speculative_tokens=0)
        for ids, got in zip(PROMPTS, target_only):
            with torch.inference_mode():
                expected = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=NEW,
                                          eos_token_id=1)[0, len(ids):]
            assert got.token_ids == expected.tolist()
    # The tolerance is far below what quantization changes: the BF16 source's own logits are not a match.
    model.load_state_dict(original)
    with torch.inference_mode():
        source = model(input_ids=torch.tensor([PROMPTS[0]])).logits[0]
    assert (ours[0] - source).abs().max() > 1e-3


@pytest.mark.parametrize("case", CASES)
def test_speculative_greedy_equals_target_only(pairs, case):
    pair = pairs(case)
    target_only = pair.generate(PROMPTS, max_new_tokens=NEW, num_speculative_tokens=0)
    assert [g.prompt_token_ids for g in target_only] == PROMPTS
    assert all(0 < len(g.token_ids) <= NEW for g in target_only)
    assert all(g.token_ids[-1] == 1 for g in target_only if len(g.token_ids) < NEW)  # only EOS ends one early
    for k in (2, 4):
        speculative = pair.generate(PROMPTS, max_new_tokens=NEW, num_speculative_tokens=k)
        assert [g.token_ids for g in speculative] == [g.token_ids for g in target_only], k
        stats = speculative[0].stats
        assert stats.num_speculative_tokens == k and len(stats.acceptance_rate_per_position) == k
        assert all(0 <= a <= k for g in speculative for a in g.accepted_lengths)


@pytest.mark.parametrize("case", CASES)
def test_kv_cache_dtype_and_scales_come_from_the_checkpoint(pairs, quantized, case):
    pair, kv = pairs(case), CASES[case][3]
    if not kv:
        assert pair.kv_cache_dtype == torch.float32 and pair.cache_scales is None
        assert pair.describe()["kv_cache"] == {"dtype": "float32", "scales": None}
        return
    assert pair.kv_cache_dtype == torch.float8_e4m3fn
    assert pair.describe()["kv_cache"] == {"dtype": "float8_e4m3fn", "scales": "checkpoint"}
    written = load_file(quantized(case) / "model.safetensors")
    # compressed-tensors keeps them on the attention, ModelOpt on the projection.
    where = "self_attn.{kind}_scale" if CASES[case][2] == "compressed-tensors" else "self_attn.{kind}_proj.{kind}_scale"
    layers = pair.target.config.num_hidden_layers  # dense_31b_like shares no KV: every layer owns its cache
    for kind in "kv":
        scales = pair.cache_scales[f"{kind}_scales"]
        assert sorted(scales) == list(range(layers))
        for layer, scale in scales.items():
            stored = written[f"model.layers.{layer}.{where.format(kind=kind)}"]
            assert stored.numel() == 1 and float(stored) > 0
            assert scale.dtype == torch.float32 and scale.flatten().tolist() == stored.float().flatten().tolist()
    # Asking for a BF16 cache drops the scales; asking for fp8 keeps the checkpoint's.
    bf16 = Pair(pair.target, pair.draft, "bf16")
    assert bf16.kv_cache_dtype == torch.bfloat16 and bf16.cache_scales is None
    assert Pair(pair.target, pair.draft, "fp8").cache_scales is pair.target.kv_scales
