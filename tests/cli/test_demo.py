"""`mtp-convert demo`: the shipped pair quantized to FP8 and NVFP4 through the real quantize and pair paths,
each kept pair valid for `check` and for vLLM's launch line, speculative output exact, and no partial output."""

from __future__ import annotations

import json
import shlex

import pytest
from safetensors import safe_open

from mtpkit.demo import ASSISTANT, TARGET


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """One short demo run (1 prompt, 8 tokens), JSON, pairs kept: shared by the tests below."""
    from typer.testing import CliRunner

    from mtpkit.cli.app import _register, app

    _register()  # what `main` does before running a command
    out = tmp_path_factory.mktemp("demo") / "pairs"
    result = CliRunner().invoke(app, ["demo", "--prompts", "1", "--max-new-tokens", "8", "--json", "--out", str(out)])
    assert result.exit_code == 0, result.output
    return out, json.loads(result.stdout)


def test_three_pairs_each_passing_check(demo_run, cli):
    out, report = demo_run
    assert sorted(p.name for p in out.iterdir()) == ["bf16", "fp8", "nvfp4"]
    for name in ("bf16", "fp8", "nvfp4"):
        result = cli("check", out / name)
        assert result.code == 0 and "0 error(s)" in result.out, result.out + result.err
    # The BF16 pair is the shipped one, byte for byte.
    assert (out / "bf16" / "target" / "model.safetensors").read_bytes() == (TARGET / "model.safetensors").read_bytes()
    assert json.loads((out / "bf16" / "draft" / "config.json").read_text())["model_type"] == "gemma4_assistant"
    assert (ASSISTANT / "config.json").is_file()


@pytest.mark.parametrize("scheme,ct_format", [("fp8", "float-quantized"), ("nvfp4", "nvfp4-pack-quantized")])
def test_quantized_targets_carry_their_scheme_and_kv_scales(demo_run, scheme, ct_format):
    out, report = demo_run
    config = json.loads((out / scheme / "target" / "config.json").read_text())
    quantization = config["quantization_config"]
    assert quantization["quant_method"] == "compressed-tensors" and quantization["format"] == ct_format
    assert quantization["kv_cache_scheme"]["num_bits"] == 8
    with safe_open(out / scheme / "target" / "model.safetensors", "pt") as f:
        names = set(f.keys())
    layers = config["num_hidden_layers"]
    assert all(f"model.layers.{i}.self_attn.k_scale" in names and f"model.layers.{i}.self_attn.v_scale" in names
               for i in range(layers))
    assert "quantization_config" not in json.loads((out / scheme / "draft" / "config.json").read_text())
    manifest = json.loads((out / scheme / "pair.json").read_text())
    assert manifest["target_quantized_by"]["scheme"] == scheme and manifest["target_kv_scales"]
    assert report["results"][scheme]["kv_cache"] == "float8_e4m3fn"


def test_launch_lines_name_the_kept_folders(demo_run):
    out, report = demo_run
    for name, line in report["vllm_serve"].items():
        assert line == json.loads((out / name / "pair.json").read_text())["launch"]["vllm_serve"]
        words = shlex.split(line)
        assert words[:2] == ["vllm", "serve"] and words[2] == str((out / name / "target").resolve())
        spec = json.loads(words[words.index("--speculative-config") + 1])
        assert spec["model"] == str((out / name / "draft").resolve()) and (out / name / "draft").is_dir()
    assert "--kv-cache-dtype" in report["vllm_serve"]["nvfp4"]


def test_results_are_exact_and_consistent(demo_run):
    _, report = demo_run
    assert report["prompts"] == 1 and report["k"] == 4
    for name, row in report["results"].items():
        assert row["exact"] is True, name  # speculative tokens == target-only tokens
        assert len(row["acceptance"]) == 4 and 1.0 <= row["mean_length"] <= 5.0
        assert all(a >= b for a, b in zip(row["acceptance"], row["acceptance"][1:]))  # prefix acceptance
        assert row["speedup"] == pytest.approx(row["speculative_tps"] / row["target_only_tps"])
        assert row["acceptance_change_vs_bf16"] == pytest.approx(
            row["mean_length"] - report["results"]["bf16"]["mean_length"])
        assert 0 < len(row["sample"]) <= 8


def test_refusals_leave_nothing(cli, tmp_path):
    existing = tmp_path / "existing"
    existing.mkdir()
    result = cli("demo", "--out", existing)
    assert result.code == 2 and "already exists" in result.err and list(existing.iterdir()) == []
    out = tmp_path / "new"
    result = cli("demo", "--target", ASSISTANT, "--out", out)  # an assistant where the target goes
    assert result.code == 2 and "--target" in result.err, result.err
    assert not out.exists()
    for option, value in (("--k", "0"), ("--prompts", "0"), ("--max-new-tokens", "0")):
        result = cli("demo", option, value, "--out", out)
        assert result.code == 2 and option in result.err and not out.exists(), result.err
