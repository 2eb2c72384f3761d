"""MoE experts (26B-A4B) as quantization targets: one per expert projection, read from its byte range.

Oracles: safetensors' own reader (`load_file`), sliced with torch, for what each expert target reads;
compressed-tensors' matcher (`match_named_modules`) on a Gemma 4 MoE whose experts are unpacked the way
llm-compressor unpacks them (src/llmcompressor/modeling/gemma4.py) for which modules targets/ignore select.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers
from compressed_tensors.utils import match_named_modules
from safetensors.torch import load_file

from mtpkit.convert.checkpoint import open_checkpoint
from mtpkit.convert.quantize_scope import CT_IGNORE, QuantTarget, moe_expert_tensors, quantization_targets, \
    replaced_tensors, selected
from mtpkit.convert.recipe import load_recipe
from mtpkit.convert.safetensors_file import TensorInfo
from mtpkit.errors import CheckpointError, ConfigError
from mtpkit.formats.quant_math import check_weight

LAYERS, EXPERTS, INNER, HIDDEN = 4, 4, 16, 32  # moe_26b_like
EXPERTS_ONLY = load_recipe("nvfp4-experts-only")
THREE_D = {f"model.layers.{i}.experts.{p}" for i in range(LAYERS) for p in ("gate_up_proj", "down_proj")}
SELECTIONS = {
    "every Linear": (["Linear"], CT_IGNORE),
    "experts-only recipe": (EXPERTS_ONLY.targets, EXPERTS_ONLY.ignore),
    "experts ignored": (["Linear"], CT_IGNORE + ["re:.*experts.*"]),
    "layer 1 by name": ([r"re:model\.layers\.1\."], CT_IGNORE),
    "attention and experts": ([r"re:.*(self_attn|experts\.\d+)\.[a-z_]+$"], CT_IGNORE),
    # Exact names: one attention projection, and every expert projection of layer 2 (a layer's experts are
    # selected all or none: see test_a_selection_that_splits_a_layers_experts_is_refused).
    "bare names": (["model.layers.2.self_attn.o_proj"] + [f"model.layers.2.experts.{e}.{p}_proj"
                                                          for e in range(EXPERTS) for p in ("gate", "up", "down")], []),
}


def _experts(targets: list[QuantTarget]) -> list[QuantTarget]:
    return [t for t in targets if ".experts." in t.module]


def test_expert_slices_equal_an_independent_reader(tiny):
    folder = tiny("moe_26b_like")
    full = load_file(folder / "model.safetensors")
    experts = _experts(quantization_targets(open_checkpoint(folder).tensors))
    assert len(experts) == LAYERS * EXPERTS * 3
    for t in experts:
        layer, e, proj = t.module.split(".")[2], int(t.module.split(".")[4]), t.module.rsplit(".", 1)[1]
        base = f"model.layers.{layer}.experts"
        if proj == "down_proj":
            expected, source, name = full[f"{base}.down_proj"][e], f"{base}.down_proj", f"{base}.down_proj[{e}]"
        else:
            rows = slice(0, INNER) if proj == "gate_proj" else slice(INNER, 2 * INNER)
            expected, source = full[f"{base}.gate_up_proj"][e, rows], f"{base}.gate_up_proj"
            name = f"{source}[{e}, {rows.start}:{rows.stop}]"
        assert (t.weight.name, t.source, t.dtype) == (name, source, "BF16")
        assert t.shape == tuple(expected.shape) == ((HIDDEN, INNER) if proj == "down_proj" else (INNER, HIDDEN))
        # Only this expert matrix's bytes are read: one [out, in] BF16 matrix, not the 3-D tensor.
        assert t.nbytes == expected.numel() * 2
        assert torch.equal(t.load(), expected), t.module
        check_weight(t.load(), "nvfp4a16", t.module)  # what quantize's first pass asks of a 2-D weight


def test_groups_share_gate_and_up_of_one_expert(tiny):
    groups: dict[str, list[str]] = {}
    for t in _experts(quantization_targets(open_checkpoint(tiny("moe_26b_like")).tensors)):
        groups.setdefault(t.group, []).append(t.module.rsplit(".", 1)[1])
    for group, members in groups.items():
        expected = ["gate_proj", "up_proj"] if group.endswith(".gate_up") else ["down_proj"]
        assert sorted(members) == expected, group
    assert "model.layers.3.experts.2.gate_up" in groups and "model.layers.3.experts.2.down_proj" in groups


def _unpacked_moe(folder) -> torch.nn.Module:
    """The MoE fixture as llm-compressor sees it: each layer's experts one Gemma4TextMLP per expert."""
    model = transformers.Gemma4ForCausalLM.from_pretrained(folder)
    for layer in model.model.layers:
        unpacked = torch.nn.Module()
        for e in range(model.config.num_experts):
            unpacked.add_module(str(e), transformers.models.gemma4.modeling_gemma4.Gemma4TextMLP(model.config, 0))
        layer.experts = unpacked
    return model


@pytest.mark.parametrize("selection", sorted(SELECTIONS))
def test_selection_matches_compressed_tensors(tiny, selection):
    targets, ignore = SELECTIONS[selection]
    folder = tiny("moe_26b_like")
    tensors = open_checkpoint(folder).tensors
    ours = quantization_targets(tensors, ignore, targets)
    # compressed-tensors quantizes the matched Linears (a regex can also name a block; only Linears get weights).
    theirs = {name for name, module in match_named_modules(_unpacked_moe(folder), targets, ignore)
              if isinstance(module, torch.nn.Linear)}
    assert {t.module for t in ours} == theirs
    assert all(selected(t.module, targets, ignore) for t in ours)
    replaced = replaced_tensors(ours)
    kept = moe_expert_tensors(tensors, ignore, targets)
    assert set(kept) == THREE_D - replaced and not set(kept) & replaced
    layer = {"layer 1 by name": "layers.1.", "bare names": "layers.2."}.get(selection)
    assert replaced & THREE_D == ({n for n in THREE_D if layer in n} if layer else
                                  set() if selection == "experts ignored" else THREE_D)


def test_experts_only_recipe_selects_only_the_experts(tiny):
    tensors = open_checkpoint(tiny("moe_26b_like")).tensors
    ours = quantization_targets(tensors, EXPERTS_ONLY.ignore, EXPERTS_ONLY.targets)
    assert len(ours) == LAYERS * EXPERTS * 3 and _experts(ours) == ours
    assert replaced_tensors(ours) == THREE_D and moe_expert_tensors(tensors, EXPERTS_ONLY.ignore,
                                                                    EXPERTS_ONLY.targets) == []
    # The defaults (every Linear, nothing ignored) also quantize the experts, and keep no 3-D tensor.
    assert moe_expert_tensors(tensors) == [] and len(_experts(quantization_targets(tensors))) == len(ours)


def test_a_multimodal_prefix(tiny):
    """`model.language_model.layers.N.experts...` (the multimodal wrapper) is sliced the same way."""
    folder = tiny("moe_26b_like")
    tensors = {("model.language_model." + n.removeprefix("model.")): dataclasses.replace(
        info, name="model.language_model." + n.removeprefix("model.")) for n, info in open_checkpoint(folder).tensors.items()}
    full = load_file(folder / "model.safetensors")
    experts = _experts(quantization_targets(tensors, CT_IGNORE, EXPERTS_ONLY.targets))
    assert len(experts) == LAYERS * EXPERTS * 3
    up = next(t for t in experts if t.module == "model.language_model.layers.2.experts.3.up_proj")
    assert up.group == "model.language_model.layers.2.experts.3.gate_up"
    assert up.source == "model.language_model.layers.2.experts.gate_up_proj"
    assert torch.equal(up.load(), full["model.layers.2.experts.gate_up_proj"][3, INNER:])


def test_a_selection_that_splits_a_layers_experts_is_refused(tiny):
    tensors = open_checkpoint(tiny("moe_26b_like")).tensors
    with pytest.raises(ConfigError, match=r"select 9 of the 12 expert projections of model\.layers\.0 .*"
                                          r"model\.layers\.0\.experts\.0\.down_proj"):
        quantization_targets(tensors, CT_IGNORE + [r"re:.*experts\.0\."])
    with pytest.raises(ConfigError, match="model.layers.3.experts"):
        quantization_targets(tensors, [], [r"re:.*layers\.3\.experts\.\d+\.(gate|up)_proj$"])


@pytest.mark.parametrize(("shapes", "message"), [
    ({"gate_up_proj": (4, 31, 32)}, "odd number of rows"),
    ({"gate_up_proj": (4, 32, 32), "down_proj": (4, 32, 8)}, r"needs \[4, 32, 16\]"),
    ({"down_proj": (4, 32)}, "a 3-D"),
])
def test_bad_expert_shapes_are_refused(tmp_path, shapes, message):
    tensors = {}
    for param, shape in shapes.items():
        name = f"model.layers.0.experts.{param}"
        tensors[name] = TensorInfo(name, "BF16", shape, tmp_path / "model.safetensors", 0, 2 * torch.Size(shape).numel())
    with pytest.raises(CheckpointError, match=message):
        quantization_targets(tensors)
