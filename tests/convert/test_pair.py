"""`pair`: layout, byte-identical target, hashes, validation, and launch lines that vLLM parses as intended."""

from __future__ import annotations

import hashlib
import json
import shlex

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import EXAMPLES, tree_digest

# Published num_speculative_tokens of the four public pairs.
PUBLISHED_TOKENS = {"E2B": 2, "E4B": 4, "26B-A4B": 4, "31B": 8}


def _speculative_config(serve: str) -> dict:
    argv = shlex.split(serve)
    assert argv[:2] == ["vllm", "serve"]
    return json.loads(argv[argv.index("--speculative-config") + 1])


def test_pair_of_tiny_checkpoints(tiny, cli, tmp_path):
    target, draft = tiny("dense_31b_like"), tiny("assistant_plain")
    out = tmp_path / "pair"
    result = cli("pair", out, "--target", target, "--draft", draft)
    assert result.code == 0, result.err
    assert sorted(p.name for p in out.iterdir()) == ["draft", "pair.json", "target"]
    # The target is copied byte for byte.
    assert tree_digest(out / "target") == tree_digest(target)
    manifest = json.loads((out / "pair.json").read_text())
    for side, folder in (("target", target), ("draft", draft)):
        for name, digest in manifest[side]["sha256"].items():
            assert hashlib.sha256((folder / name).read_bytes()).hexdigest() == digest
        assert manifest[side]["path"] == str(folder.resolve())
    # The draft is canonical and its tensors untouched (a pure config fix).
    draft_config = json.loads((out / "draft" / "config.json").read_text())
    assert draft_config["model_type"] == "gemma4_assistant" and "per_layer_config" not in draft_config["text_config"]
    original, written = load_file(draft / "model.safetensors"), load_file(out / "draft" / "model.safetensors")
    assert original.keys() == written.keys() and all(torch.equal(original[k], written[k]) for k in original)
    assert manifest["validation"] == [] and manifest["target_quantization"] is None
    # Launch lines: vLLM's speculative config with the draft folder; no method key; no fp8 KV without scales.
    serve = manifest["launch"]["vllm_serve"]
    spec = _speculative_config(serve)
    assert spec == {"model": str((out / "draft").resolve()), "num_speculative_tokens": 4}
    assert shlex.split(serve)[2] == str((out / "target").resolve()) and "--kv-cache-dtype" not in serve
    assert "method" not in serve and "draft_model" not in serve
    assert "speculative_config={'model'" in manifest["launch"]["python"]
    # The pair passes check as written.
    assert cli("check", out).code == 0


def test_pair_is_deterministic(tiny, cli, tmp_path):
    for name in ("a", "b"):
        assert cli("pair", tmp_path / name, "--target", tiny("e2b_like"), "--draft", tiny("assistant_centroids")).code == 0
    a, b = tree_digest(tmp_path / "a"), tree_digest(tmp_path / "b")
    assert a.keys() == b.keys() and all(a[k] == b[k] for k in a if k != "pair.json")
    # pair.json names its own output folder in the launch lines, and nothing else differs.
    text_a = (tmp_path / "a" / "pair.json").read_text().replace(str((tmp_path / "a").resolve()), "OUT")
    text_b = (tmp_path / "b" / "pair.json").read_text().replace(str((tmp_path / "b").resolve()), "OUT")
    assert text_a == text_b


def test_target_with_kv_scales_gets_an_fp8_kv_cache_line(tiny_copy, tiny, cli, tmp_path):
    target = tiny_copy("dense_31b_like")
    tensors = load_file(target / "model.safetensors")
    for layer in range(6):
        tensors[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(0.02)
        tensors[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor(0.03)
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "pair"
    assert cli("pair", out, "--target", target, "--draft", tiny("assistant_plain")).code == 0
    manifest = json.loads((out / "pair.json").read_text())
    assert manifest["target_kv_scales"] is True
    assert manifest["launch"]["vllm_serve"].endswith(" --kv-cache-dtype fp8")
    assert manifest["launch"]["python"].endswith(', kv_cache_dtype="fp8")')


def test_a_failing_pair_writes_nothing_and_exits_1(tiny, cli, tmp_path):
    result = cli("pair", tmp_path / "pair", "--target", tiny("e2b_like"), "--draft", tiny("assistant_plain"))
    assert result.code == 1
    assert "[backbone-hidden-size]" in result.err and result.err.strip().splitlines()[-1].startswith("mtp-convert: error:")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("model", PUBLISHED_TOKENS)
def test_published_pairs_config_only_get_the_published_token_count(cli, tmp_path, model):
    out = tmp_path / "pair"
    result = cli("pair", out, "--target", EXAMPLES / f"gemma-4-{model}-it",
                 "--draft", EXAMPLES / f"gemma-4-{model}-it-assistant", "--json")
    assert result.code == 0, result.err
    manifest = json.loads(result.out)
    assert manifest["num_speculative_tokens"]["value"] == PUBLISHED_TOKENS[model]
    assert _speculative_config(manifest["launch"]["vllm_serve"])["num_speculative_tokens"] == PUBLISHED_TOKENS[model]
    assert manifest["draft_rules"] == []  # the published assistants are already canonical


def test_pair_quantize_writes_a_quantized_target_beside_a_bf16_draft(tiny, cli, tmp_path):
    """`pair --quantize` equals `quantize` then `pair`: same target bytes, the draft untouched, FP8 KV launch."""
    g = torch.Generator().manual_seed(7)
    calib = tmp_path / "calib.jsonl"
    calib.write_text("".join(json.dumps({"input_ids": torch.randint(3, 120, (9,), generator=g).tolist()}) + "\n"
                             for _ in range(3)))
    target, draft = tiny("e2b_like"), tiny("assistant_centroids")
    out = tmp_path / "pair"
    result = cli("pair", out, "--target", target, "--draft", draft, "--quantize", "nvfp4", "--kv-cache", "fp8",
                 "--calib", calib)
    assert result.code == 0, result.err
    assert cli("quantize", target, tmp_path / "q", "--scheme", "nvfp4", "--kv-cache", "fp8", "--calib", calib).code == 0
    assert tree_digest(out / "target") == tree_digest(tmp_path / "q")
    manifest = json.loads((out / "pair.json").read_text())
    assert manifest["target_quantization"]["scheme"] == "nvfp4" and manifest["target_kv_scales"] is True
    assert manifest["target_quantized_by"]["scheme"] == "nvfp4" and manifest["target_quantized_by"]["kv_cache"] == "fp8"
    assert manifest["target"]["path"] == str(target.resolve())  # the source, with its hashes
    assert manifest["launch"]["vllm_serve"].endswith(" --kv-cache-dtype fp8")
    draft_config = json.loads((out / "draft" / "config.json").read_text())
    assert "quantization_config" not in draft_config and "quantization_config" not in draft_config["text_config"]
    original, written = load_file(draft / "model.safetensors"), load_file(out / "draft" / "model.safetensors")
    assert all(torch.equal(original[k], written[k]) for k in original)
    assert cli("check", out).code == 0


def test_pair_calibration_options_need_quantize(tiny, cli, tmp_path):
    result = cli("pair", tmp_path / "p", "--target", tiny("e2b_like"), "--draft", tiny("assistant_centroids"),
                 "--kv-cache", "fp8")
    assert result.code == 2 and "--quantize" in result.err and not (tmp_path / "p").exists()
