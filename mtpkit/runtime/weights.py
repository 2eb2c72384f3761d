"""Load a checkpoint's text-decoder tensors into Gemma4TextModel by stripping one prefix.

Quantized Linear weights (FP8, NVFP4) load as they are stored, into QuantizedLinear modules (linears.py).
MoE experts stored per expert (quantized or dense) are dequantized into the fused dense tensors that
runtime.moe.Experts holds (see moe.fuse_expert_tensors for why they are not kept quantized).
"""

from __future__ import annotations

import torch

from mtpkit.formats.dequantize import ACTIVATION_SCALE_SUFFIXES
from mtpkit.formats.gemma4 import text_prefix
from mtpkit.runtime.linears import swap_quantized_linears
from mtpkit.runtime.model import Gemma4TextModel
from mtpkit.runtime.moe import fuse_expert_tensors

# Towers of the multimodal wrapper, which the text decoder never reads.
_OTHER_TOWERS = ("model.vision_tower.", "model.embed_vision.", "model.audio_tower.", "model.embed_audio.")


def load_text_state_dict(model: Gemma4TextModel, tensors: dict[str, torch.Tensor]) -> None:
    """Copy `tensors` (names as in the checkpoint) into `model`, cast to its dtype, strictly.

    Missing or unexpected text tensors, or a shape that differs, raise ValueError naming them;
    vision and audio tensors are ignored. A tied lm_head is absent from checkpoints; an untied one
    is the top-level `lm_head.weight`.

    A Linear whose tensors are quantized (weight + weight_scale, weight_packed, ...) is first replaced by a
    QuantizedLinear that keeps them as stored. MoE experts may come fused (`experts.gate_up_proj` [E, 2I, H],
    `experts.down_proj` [E, H, I]) or per expert (`experts.<e>.{gate,up,down}_proj.{weight, weight_packed,
    weight_scale, weight_global_scale, weight_scale_2}`); per-expert ones are dequantized into the fused dense
    tensors (held dense for now: moe.fuse_expert_tensors says why), and a missing one raises ValueError naming it.
    Activation and KV-cache scales (input_scale, input_global_scale, k_scale, v_scale) are dropped: the runtime
    dequantizes weights only and runs activations unquantized.
    """
    prefix = text_prefix(tensors)
    state = {}
    unexpected = []
    for name, tensor in tensors.items():
        if name.startswith(_OTHER_TOWERS) or name.rpartition(".")[2] in ACTIVATION_SCALE_SUFFIXES:
            continue
        if name.startswith(prefix):
            state[name[len(prefix):]] = tensor
        elif name == "lm_head.weight" and not model.config.tie_word_embeddings:
            state[name] = tensor
        elif name != "lm_head.weight":  # a tied lm_head written out anyway is the embedding again
            unexpected.append(name)
    fuse_expert_tensors(model, state, prefix)  # first: per-expert Linears are not modules the swap could fill
    swap_quantized_linears(model, state)
    expected = model.state_dict()
    unexpected += [prefix + name for name in state if name not in expected]
    missing = [prefix + name for name in expected if name not in state]
    if missing or unexpected:
        raise ValueError(f"text tensors do not match the config: missing {sorted(missing)}, "
                         f"unexpected {sorted(unexpected)}")
    wrong = [f"{prefix}{name} {tuple(t.shape)} (expected {tuple(expected[name].shape)})"
             for name, t in state.items() if t.shape != expected[name].shape]
    if wrong:
        raise ValueError(f"text tensors have the wrong shape: {', '.join(wrong)}")
    model.load_state_dict(state, strict=True)
