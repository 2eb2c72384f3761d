"""`quantize` with calibration: static input scales, FP8 KV-cache scales, the evaluation report.

Oracles: transformers (its hooks give the ranges; it loads our fp8 / fp8-dynamic outputs and runs them with
compressed-tensors' activation quantization, which our evaluation must reproduce), compressed-tensors'
`generate_gparam` for the NVFP4 input global scale, and the formulas amax / 448.
"""

from __future__ import annotations

import json

import pytest
import torch
from compressed_tensors.quantization import QuantizationConfig
from compressed_tensors.quantization.utils import generate_gparam
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from mtpkit.calibrate.evaluate import _activation_hooks
from mtpkit.calibrate.layerwise import LayerwiseStream
from mtpkit.convert.checkpoint import open_checkpoint
from mtpkit.formats.compressed_tensors import FP8_KV_CACHE
from mtpkit.loader.text_parts import TextCheckpoint
from tests.calibrate.test_observe import _transformers_ranges
from tests.conftest import tree_digest

LENGTHS = (7, 5, 6, 7)  # within the fixtures' sliding window, so transformers' cache keeps every key


@pytest.fixture
def calib(calib_file):
    return calib_file(LENGTHS, 3)


def _group_max(ranges: dict[str, float], module: str) -> float:
    """vLLM fuses q/k/v and gate/up: their one input scale covers the group."""
    layer, _, proj = module.rpartition(".")
    group = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gu", "up_proj": "gu"}.get(proj)
    if group is None:
        return ranges[module]
    members = ("q_proj", "k_proj", "v_proj") if group == "qkv" else ("gate_proj", "up_proj")
    return max(ranges[f"{layer}.{m}"] for m in members if f"{layer}.{m}" in ranges)


@pytest.mark.parametrize(("name", "scheme"), [("dense_31b_like", "fp8"), ("e2b_like", "nvfp4"),
                                              ("multimodal", "fp8")])
def test_static_and_kv_scales_follow_the_ranges_transformers_sees(tiny, cli, calib, tmp_path, name, scheme):
    path, sequences = calib
    src, out = tiny(name), tmp_path / "q"
    result = cli("quantize", src, out, "--scheme", scheme, "--kv-cache", "fp8", "--calib", path, "--json")
    assert result.code == 0, result.err
    ranges, kv, _ = _transformers_ranges(src, sequences, torch.bfloat16)  # the checkpoints' dtype, as calibrated
    tensors = load_file(out / "model.safetensors")
    report = json.loads(result.out)
    modules = sorted(report["relative_weight_error"])
    for module in modules:
        amax = torch.tensor([_group_max(ranges, module)])
        if scheme == "fp8":
            assert tensors[f"{module}.input_scale"].dtype == torch.bfloat16
            assert torch.equal(tensors[f"{module}.input_scale"], (amax / 448).to(torch.bfloat16))
        else:
            theirs = generate_gparam(-amax, amax)
            assert torch.equal(tensors[f"{module}.input_global_scale"], theirs)
    # Every attention layer has k/v scales; a KV-shared layer carries the scales of the layer it reads.
    text = TextCheckpoint(open_checkpoint(src))
    config = text.config
    for layer in range(config.num_hidden_layers):
        source = config.kv_source[layer]
        for kind, amax in zip("kv", kv[source]):
            scale = tensors[f"{text.prefix}layers.{layer}.self_attn.{kind}_scale"]
            assert scale.dtype == torch.float32 and scale.shape == (1,)
            assert float(scale) == pytest.approx(amax / 448, rel=1e-6)
    written = json.loads((out / "config.json").read_text())["quantization_config"]
    assert written["kv_cache_scheme"] == FP8_KV_CACHE
    parsed = QuantizationConfig.model_validate(written)  # compressed-tensors reads what we wrote
    assert parsed.kv_cache_scheme.num_bits == 8 and parsed.kv_cache_scheme.strategy == "tensor"
    assert report["calibration"]["samples"] == len(LENGTHS) and report["calibration"]["source"] == path.name
    saved = json.loads((out / "mtpkit_quantize.json").read_text())
    assert report["kv_cache"] == "fp8" and saved == {k: v for k, v in report.items() if k != "output"}
    evaluation = report["evaluation"]
    assert evaluation["tokens"] == sum(LENGTHS) and evaluation["kv_cache"] == "fp8 with the written scales"
    assert 0 < evaluation["max_abs_logit_error"] < 2 and 0 < evaluation["top1_agreement"] <= 1


@pytest.mark.parametrize("scheme", ["fp8", "fp8-dynamic"])
def test_transformers_runs_our_output_as_our_evaluation_does(tiny, cli, calib, tmp_path, scheme):
    """transformers + compressed-tensors quantize each Linear's input with the written scales; the quantized
    stream of our report must compute the same logits (float32, so any scale or rounding difference shows)."""
    path, sequences = calib
    out = tmp_path / "q"
    assert cli("quantize", tiny("dense_31b_like"), out, "--scheme", scheme, "--calib", path).code == 0
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    text = TextCheckpoint(open_checkpoint(out), dtype=torch.float32)
    stream = LayerwiseStream(text, sequences)
    for i in range(stream.num_layers):
        stream.run_layer(i, _activation_hooks(text, scheme))
    unquantized = LayerwiseStream(text, sequences)
    for i in range(unquantized.num_layers):
        unquantized.run_layer(i)
    for b, tokens in enumerate(sequences):
        with torch.no_grad():
            theirs = model(tokens[None]).logits[0]
        torch.testing.assert_close(stream.logits(b), theirs, rtol=0, atol=1e-6)
        assert not torch.allclose(unquantized.logits(b), theirs, atol=1e-4)  # activation quantization mattered


def test_text_calibration_uses_the_targets_tokenizer(tiny_copy, cli, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    src = tiny_copy("dense_31b_like")
    vocab = {"<unk>": 3, **{chr(c): 10 + i for i, c in enumerate(range(ord("a"), ord("z") + 1))}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tokenizer.save(str(src / "tokenizer.json"))
    text = tmp_path / "calib.txt"
    text.write_text("hello world\n\nabc\n\n\n  the quick brown fox  \n")
    out = tmp_path / "q"
    result = cli("quantize", src, out, "--scheme", "nvfp4", "--calib", text, "--calib-tokens", "8", "--json")
    assert result.code == 0, result.err
    report = json.loads(result.out)
    bos = json.loads((src / "config.json").read_text()).get("bos_token_id")
    expected = [min(8, 1 + len(t)) for t in ("hello world", "abc", "the quick brown fox")]
    assert report["calibration"]["samples"] == 3 and report["calibration"]["tokens"] == sum(expected)
    assert isinstance(bos, int)
    # No --calib: the default set, tokenized with the same tokenizer.
    result = cli("quantize", src, tmp_path / "d", "--scheme", "fp8", "--json")
    assert result.code == 0, result.err
    assert json.loads(result.out)["calibration"]["source"] == "mtpkit:default_calibration.jsonl"


def test_deterministic_with_calibration(tiny, cli, calib, tmp_path):
    path, _ = calib
    for run in ("a", "b"):
        args = ("quantize", tiny("e2b_like"), tmp_path / run, "--scheme", "nvfp4", "--kv-cache", "fp8", "--calib", path)
        assert cli(*args).code == 0
    assert tree_digest(tmp_path / "a") == tree_digest(tmp_path / "b")


def test_recipes_that_need_calibration_calibrate(tiny, cli, calib, tmp_path):
    path, _ = calib
    for recipe, scheme, kv in (("fp8", "fp8", None), ("nvfp4", "nvfp4", None), ("kv-fp8", "fp8-dynamic", "fp8")):
        result = cli("quantize", tiny("dense_31b_like"), tmp_path / recipe, "--recipe", recipe, "--calib", path, "--json")
        assert result.code == 0, result.err
        report = json.loads(result.out)
        assert (report["scheme"], report["kv_cache"]) == (scheme, kv) and report["calibration"]["samples"] == 4


def test_weight_only_without_text_says_it_did_not_evaluate(tiny, cli, tmp_path):
    result = cli("quantize", tiny("dense_31b_like"), tmp_path / "q", "--scheme", "nvfp4a16", "--json")
    assert result.code == 0, result.err
    assert "tokenizer.json" in json.loads(result.out)["evaluation"]["skipped"]


@pytest.mark.parametrize(("content", "suffix", "message"), [
    (None, ".txt", "tokenizer.json"),  # default set is text; the fixture has no tokenizer
    ('{"input_ids": [1, 2]}\nnot json\n', ".jsonl", "line 2 is not JSON"),
    ('{"input_ids": [1, 999]}\n', ".jsonl", "input_ids must be"),
    ('{"prompt": "x"}\n', ".jsonl", "neither"),
    ("", ".txt", "holds no samples"),
])
def test_bad_calibration_input(tiny, cli, tmp_path, content, suffix, message):
    src = tiny("dense_31b_like")
    args = []
    if content is not None:
        path = tmp_path / f"calib{suffix}"
        path.write_text(content)
        args = ["--calib", path]
    before = tree_digest(src)
    result = cli("quantize", src, tmp_path / "out", "--scheme", "fp8", *args)
    assert result.code == 2 and message in result.err and len(result.err.strip().splitlines()) == 1, result.err
    assert not (tmp_path / "out").exists() and tree_digest(src) == before
