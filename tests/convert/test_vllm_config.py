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
