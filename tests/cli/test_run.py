"""`mtp-convert run`: the CLI over load_pair; its output against the API and the runtime (the oracle for
speculative decoding is the target's own greedy decoding, checked against transformers in tests/runtime)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from mtpkit.loader import load_pair
from tests.conftest import tree_digest

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]


@pytest.fixture
def prompt_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in PROMPTS))
    return path


@pytest.fixture
def pair_dir(tiny, cli, tmp_path):
    out = tmp_path / "pair"
    assert cli("pair", out, "--target", tiny("e2b_like"), "--draft", tiny("assistant_centroids")).code == 0
    return out


def test_json_equals_the_api_and_target_only_greedy(cli, pair_dir, prompt_file):
    result = cli("run", pair_dir, "--prompt-file", prompt_file, "--max-new-tokens", "12", "--dtype", "float32",
                 "--num-speculative-tokens", "3", "--json")
    assert result.code == 0, result.err
    report = json.loads(result.out)
    pair = load_pair(pair_dir, dtype="float32", device="cpu")
    alone = pair.generate(PROMPTS, max_new_tokens=12, num_speculative_tokens=0)
    assert [r["token_ids"] for r in report["results"]] == [g.token_ids for g in alone]
    assert [r["prompt_token_ids"] for r in report["results"]] == PROMPTS
    assert len(report["stats"]["acceptance_rate_per_position"]) == 3 and report["stats"]["tokens_generated"] == 24
    assert report["describe"]["kv_map"] and report["describe"]["draft"]["centroids"] is True


def test_streams_to_stdout_and_stats_to_stderr(cli, pair_dir, prompt_file):
    result = cli("run", pair_dir, "--prompt-file", prompt_file, "--max-new-tokens", "5", "--dtype", "float32")
    assert result.code == 0, result.err
    pair = load_pair(pair_dir, dtype="float32", device="cpu")
    expected = [g.token_ids for g in pair.generate(PROMPTS, max_new_tokens=5)]
    # No tokenizer in the fixture: each prompt's token ids are its output line.
    assert [list(map(int, line.split())) for line in result.out.strip().splitlines()] == expected
    stats = [line for line in result.err.splitlines() if line.startswith("[prompt ")]
    assert len(stats) == 2 and "tokens/s" in stats[0] and "acceptance per draft position" in stats[0]


def test_sampling_is_seeded(cli, pair_dir, prompt_file):
    runs = [cli("run", pair_dir, "--prompt-file", prompt_file, "--max-new-tokens", "6", "--temperature", "0.8",
                "--top-p", "0.9", "--seed", str(seed), "--json") for seed in (1, 1, 2)]
    assert all(r.code == 0 for r in runs), runs[0].err
    outputs = [[r["token_ids"] for r in json.loads(run.out)["results"]] for run in runs]
    assert outputs[0] == outputs[1]


def test_bad_input(tiny, tiny_copy, cli, pair_dir, prompt_file, tmp_path):
    before = tree_digest(pair_dir)
    cases = [
        ((pair_dir, "--prompt-file", prompt_file, "--max-memory", "1KB"), 2, "--max-memory budget"),
        ((pair_dir,), 2, "no prompt given"),
        ((pair_dir, "--prompt", "hello"), 2, "tokenizer"),
        ((tmp_path / "nowhere", "--prompt-file", prompt_file), 2, "no such folder"),
        ((tiny("e2b_like"), "--prompt-file", prompt_file), 2, "not a pair folder"),
        (("--target", tiny("e2b_like"), "--draft", tiny("assistant_plain"), "--prompt-file", prompt_file), 1,
         "fails"),
    ]
    for args, code, message in cases:
        result = cli("run", *args)
        assert result.code == code and len(result.err.strip().splitlines()) == 1 and message in result.err, \
            (args, result.err)
    contaminated = tiny_copy("assistant_centroids")
    config = json.loads((contaminated / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "NVFP4"}
    (contaminated / "config.json").write_text(json.dumps(config))
    result = cli("run", "--target", tiny("e2b_like"), "--draft", contaminated, "--prompt-file", prompt_file)
    assert result.code in (1, 2) and "mtp-convert draft" in result.err, result.err
    assert tree_digest(pair_dir) == before


def test_fp8_kv_cache_from_the_checkpoints_scales(tiny, cli, tmp_path, prompt_file):
    calib = tmp_path / "calib.jsonl"
    calib.write_text(json.dumps({"input_ids": list(range(3, 40))}) + "\n")
    out = tmp_path / "pair"
    assert cli("pair", out, "--target", tiny("e2b_like"), "--draft", tiny("assistant_centroids"), "--quantize",
               "fp8-dynamic", "--kv-cache", "fp8", "--calib", calib).code == 0
    result = cli("run", out, "--prompt-file", prompt_file, "--max-new-tokens", "6", "--json")
    assert result.code == 0, result.err
    report = json.loads(result.out)
    assert report["describe"]["kv_cache"] == {"dtype": "float8_e4m3fn", "scales": "checkpoint"}
    pair = load_pair(out, device="cpu")
    tensors = load_file(out / "target" / "model.safetensors")
    for layer, scale in pair.cache_scales["k_scales"].items():
        assert torch.equal(scale, tensors[f"model.layers.{layer}.self_attn.k_scale"].float())
