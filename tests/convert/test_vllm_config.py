"""vLLM's own config loader on `draft` outputs: the assistant resolves as an MTP draft with no quantization.

Runs only where vLLM is installed (it is not a dependency of mtpkit, and needs no GPU for this:
`VLLM_TARGET_DEVICE=cpu`; see README, "Checking against vLLM"). The oracle is vLLM itself:
`SpeculativeConfig` built exactly as `vllm serve --speculative-config '{"model": DRAFT, ...}'` does.
"""

from __future__ import annotations

import json
import os

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
vllm_config = pytest.importorskip("vllm.config")

NVFP4 = {"quant_method": "modelopt", "quant_algo": "NVFP4", "kv_cache_quant_algo": "FP8", "group_size": 16,
         "exclude_modules": ["lm_head"]}


def _speculative(target, draft):
    target_config = vllm_config.ModelConfig(model=str(target), tokenizer=str(target), skip_tokenizer_init=True,
                                            dtype="bfloat16", max_model_len=256, enforce_eager=True)
    return vllm_config.SpeculativeConfig(model=str(draft), num_speculative_tokens=4, target_model_config=target_config,
                                         target_parallel_config=vllm_config.ParallelConfig())


def test_broken_assistant_is_quantized_by_vllm_and_drafted_one_is_not(tiny, tiny_copy, cli, tmp_path):
    broken = tiny_copy("assistant_plain")
    config = json.loads((broken / "config.json").read_text())
    config["quantization_config"] = NVFP4  # inherited from a ModelOpt NVFP4 target
    (broken / "config.json").write_text(json.dumps(config))
    assert _speculative(tiny("dense_31b_like"), broken).draft_model_config.quantization is not None

    assert cli("draft", broken, tmp_path / "draft").code == 0
    spec = _speculative(tiny("dense_31b_like"), tmp_path / "draft")
    assert spec.method == "mtp" and spec.draft_model_config.quantization is None
    assert spec.draft_model_config.hf_config.model_type == "gemma4_mtp"  # vLLM's in-memory rename


def test_gemma4_mtp_on_disk_is_rejected_by_vllm_and_repaired_by_draft(tiny, tiny_copy, cli, tmp_path):
    broken = tiny_copy("assistant_plain")
    config = json.loads((broken / "config.json").read_text())
    config.update(model_type="gemma4_mtp", architectures=["Gemma4MTPModel"])
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(Exception, match="gemma4_mtp"):
        _speculative(tiny("dense_31b_like"), broken)
    assert cli("draft", broken, tmp_path / "draft").code == 0
    assert _speculative(tiny("dense_31b_like"), tmp_path / "draft").method == "mtp"


@pytest.mark.parametrize(("scheme", "fmt", "method"), [
    ("nvfp4", "compressed-tensors", "compressed-tensors"), ("fp8", "compressed-tensors", "compressed-tensors"),
    ("nvfp4", "modelopt", "modelopt_fp4"), ("nvfp4a16", "modelopt", "modelopt_fp4"), ("fp8", "modelopt", "modelopt"),
    ("fp8-dynamic", "modelopt", "modelopt")])
def test_vllm_reads_our_quantized_targets(tiny, cli, tmp_path, scheme, fmt, method):
    """`quantize` outputs (FP8 KV cache included) resolve to vLLM's quantization method and parse in its config
    class; paired with an assistant, the draft stays unquantized."""
    from vllm.model_executor.layers.quantization import get_quantization_config

    calib = tmp_path / "calib.jsonl"
    calib.write_text(json.dumps({"input_ids": list(range(3, 40))}) + "\n")
    out = tmp_path / "q"
    assert cli("quantize", tiny("e2b_like"), out, "--scheme", scheme, "--format", fmt, "--kv-cache", "fp8",
               "--calib", calib).code == 0
    assert cli("pair", tmp_path / "pair", "--target", out, "--draft", tiny("assistant_centroids")).code == 0
    spec = _speculative(tmp_path / "pair" / "target", tmp_path / "pair" / "draft")
    assert spec.target_model_config.quantization == method and spec.draft_model_config.quantization is None
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    get_quantization_config(method).from_config(config)  # raises on anything vLLM cannot read
