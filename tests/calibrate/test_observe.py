"""Calibration ranges against transformers (the oracle): hooks on its Linears, its KV cache, its experts."""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma4ForCausalLM, Gemma4ForConditionalGeneration

from mtpkit.calibrate.data import CalibrationSet
from mtpkit.calibrate.observe import observe
from mtpkit.convert.checkpoint import open_checkpoint
from mtpkit.loader.text_parts import TextCheckpoint

# Shorter than the fixtures' sliding window (8): transformers' sliding cache then keeps every key it saw.
LENGTHS = (7, 5, 6)


def _sequences() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 120, (n,), generator=g) for n in LENGTHS]


def _transformers_ranges(folder, sequences, dtype=torch.float32):
    """max |input| of every nn.Linear and max |K|, |V| of every cache layer, from transformers in `dtype`."""
    config = open_checkpoint(folder).config
    cls = Gemma4ForConditionalGeneration if config["model_type"] == "gemma4" else Gemma4ForCausalLM
    model = cls.from_pretrained(folder, dtype=dtype, attn_implementation="eager",
                                experts_implementation="eager").eval()
    linears, kv = {}, {}
    handles = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and ".layers." in name:
            def hook(_m, args, name=name):
                linears[name] = max(linears.get(name, 0.0), float(args[0].abs().max()))
            handles.append(module.register_forward_pre_hook(hook))
    with torch.no_grad():
        for tokens in sequences:
            cache = model(tokens[None], use_cache=True).past_key_values
            for i, layer in enumerate(cache.layers):
                if layer.keys is None or layer.keys.numel() == 0:
                    continue
                k, v = float(layer.keys.abs().max()), float(layer.values.abs().max())
                old = kv.get(i, (0.0, 0.0))
                kv[i] = (max(old[0], k), max(old[1], v))
    for handle in handles:
        handle.remove()
    return linears, kv, model


@pytest.mark.parametrize("name", ["e2b_like", "moe_26b_like", "dense_31b_like", "multimodal"])
def test_ranges_equal_transformers(tiny, name):
    folder = tiny(name)
    sequences = _sequences()
    text = TextCheckpoint(open_checkpoint(folder), dtype=torch.float32)
    observed = observe(text, CalibrationSet(sequences, {"source": "test"}))
    linears, kv, model = _transformers_ranges(folder, sequences)
    assert linears
    for module, value in linears.items():
        assert observed.linear_input_amax[module] == pytest.approx(value, rel=1e-5), module
    # Every cache-owning layer, and only those (KV-shared layers write nothing).
    owning = [i for i in range(text.config.num_hidden_layers) if not text.config.is_kv_shared(i)]
    assert sorted(observed.kv_amax) == owning
    for layer in owning:
        assert observed.kv_amax[layer] == pytest.approx(kv[layer], rel=1e-5), layer
    if text.config.enable_moe_block:
        _check_experts(observed, model, text, sequences)


def _check_experts(observed, model, text, sequences):
    """Every expert calibrated on every token: gate/up see the MoE input, down sees act(gate) * up."""
    prefix = text.prefix
    inputs = {}
    handles = []
    for i, layer in enumerate(model.model.layers):
        def hook(_m, args, i=i):
            inputs.setdefault(i, []).append(args[0].detach())
        handles.append(layer.experts.register_forward_pre_hook(hook))
    with torch.no_grad():
        for tokens in sequences:
            model(tokens[None])
    for handle in handles:
        handle.remove()
    act = torch.nn.functional.gelu
    for i, layer in enumerate(model.model.layers):
        x = torch.cat(inputs[i])
        experts = layer.experts
        for e in range(text.config.num_experts):
            gate, up = (x @ experts.gate_up_proj[e].T).chunk(2, dim=-1)
            down_in = act(gate, approximate="tanh") * up
            base = f"{prefix}layers.{i}.experts.{e}"
            assert observed.linear_input_amax[f"{base}.gate_proj"] == pytest.approx(float(x.abs().max()), rel=1e-5)
            assert observed.linear_input_amax[f"{base}.up_proj"] == pytest.approx(float(x.abs().max()), rel=1e-5)
            assert observed.linear_input_amax[f"{base}.down_proj"] == pytest.approx(float(down_in.detach().abs().max()),
                                                                                     rel=1e-4)
