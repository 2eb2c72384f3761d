"""A target checkpoint's text decoder, loaded into the runtime one part at a time.

Layer-by-layer passes (calibration, quantization reports) hold one decoder layer at a time: the model is
built on the meta device (Gemma4TextModel.skeleton), each part's tensors are read from the checkpoint
(memory-mapped) and assigned in place, quantized Linears are swapped in first, and the part goes back to
the meta device when the pass is done with it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mtpkit.convert.checkpoint import Checkpoint
from mtpkit.convert.safetensors_file import load_tensor
from mtpkit.errors import CheckpointError, ConfigError
from mtpkit.formats.dequantize import ACTIVATION_SCALE_SUFFIXES, WEIGHT_SCALE_SUFFIXES
from mtpkit.formats.gemma4 import text_prefix
from mtpkit.runtime import Gemma4TextModel, TextConfig, swap_quantized_linears
from mtpkit.runtime.moe import fuse_expert_tensors

# The parts of Gemma4TextModel outside its decoder layers that a checkpoint holds.
OUTER_PARTS = ("embed_tokens", "embed_tokens_per_layer", "per_layer_model_projection", "per_layer_projection_norm",
               "norm")


class TextCheckpoint:
    """The text decoder of a target checkpoint (text-only or the multimodal wrapper), read part by part."""

    def __init__(self, checkpoint: Checkpoint, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None):
        where = str(checkpoint.folder / "config.json")
        try:
            self.config = TextConfig.from_dict(checkpoint.config, where=where)
        except ValueError as e:
            raise ConfigError(str(e), where=where, fix="point at a Gemma 4 target") from None
        self.checkpoint = checkpoint
        names = checkpoint.tensors
        self.prefix = text_prefix(names)
        embed = names.get(self.prefix + "embed_tokens.weight")
        if embed is None:
            raise CheckpointError(f"has no {self.prefix}embed_tokens.weight", where=checkpoint.folder,
                                  fix="point at a Gemma 4 target checkpoint with its weights")
        self.dtype = dtype or load_tensor(embed).dtype
        self.device = torch.device(device) if device is not None else torch.device("cpu")

    def skeleton(self) -> Gemma4TextModel:
        model = Gemma4TextModel.skeleton(self.config)
        for module in model.modules():  # the computed buffers (RoPE, embedding scales) go to the device now
            for name, buffer in module._buffers.items():
                if buffer is not None and not buffer.is_meta:
                    module._buffers[name] = buffer.to(self.device)
        return model

    def load_all(self, model: Gemma4TextModel, on_part: Callable[[str], None] | None = None) -> None:
        """Every part, layer by layer (a whole target, for the runtime)."""
        self.load_outer(model)
        for i in range(self.config.num_hidden_layers):
            self.load(model, f"layers.{i}")
            if on_part:
                on_part(f"layers.{i}")

    def _state(self, part: str) -> dict[str, torch.Tensor]:
        if part == "lm_head":  # untied: a top-level tensor, outside the decoder's prefix
            start = "lm_head."
        else:
            start = f"{self.prefix}{part}."
        state = {}
        for name, info in self.checkpoint.tensors.items():
            if name.startswith(start) and name.rpartition(".")[2] not in ACTIVATION_SCALE_SUFFIXES:
                state[name[len(start):]] = load_tensor(info)
        return state

    def load(self, model: Gemma4TextModel, part: str) -> None:
        """Fill `model.<part>` (e.g. "layers.3", "embed_tokens", "lm_head") from the checkpoint, strictly."""
        module = model.get_submodule(part)
        state = self._state(part)
        if part.startswith("layers."):
            # MoE experts stored per expert (quantized checkpoints) become the fused tensors Experts holds.
            named = {f"{part}.{name}": tensor for name, tensor in state.items()}
            try:
                fuse_expert_tensors(model, named, self.prefix)
            except ValueError as e:
                raise CheckpointError(str(e), where=self.checkpoint.folder, fix="check the checkpoint") from None
            state = {name[len(part) + 1:]: tensor for name, tensor in named.items()}
        swap_quantized_linears(module, state)
        for name, tensor in state.items():
            # Stored FP8 / FP4 codes and their scales stay as written; everything else computes in self.dtype.
            if tensor.is_floating_point() and tensor.element_size() > 1 and \
                    name.rpartition(".")[2] not in WEIGHT_SCALE_SUFFIXES:
                tensor = tensor.to(self.dtype)
            state[name] = tensor.to(self.device)
        expected = module.state_dict()
        missing = sorted(set(expected) - set(state))
        unexpected = sorted(set(state) - set(expected))
        if missing or unexpected:
            raise CheckpointError(f"{part}: tensors do not match the config: missing {missing}, unexpected {unexpected}",
                                  where=self.checkpoint.folder, fix="check the checkpoint against its config.json")
        module.load_state_dict(state, strict=True, assign=True)

    def load_outer(self, model: Gemma4TextModel) -> None:
        """Embeddings, per-layer-input parts, final norm and an untied lm_head."""
        for part in OUTER_PARTS:
            if hasattr(model, part):
                self.load(model, part)
        if not self.config.tie_word_embeddings:
            self.load(model, "lm_head")

    def kv_scales(self) -> dict[str, dict[int, torch.Tensor]] | None:
        """The checkpoint's FP8 KV-cache scales per cache-owning layer, as KVCache's k_scales / v_scales, or
        None when it has none. compressed-tensors keeps them on the attention (`self_attn.k_scale`),
        ModelOpt on the projection (`self_attn.k_proj.k_scale`)."""
        tensors, config = self.checkpoint.tensors, self.config
        found: dict[str, dict[int, torch.Tensor]] = {"k_scales": {}, "v_scales": {}}
        for layer in range(config.num_hidden_layers):
            if config.is_kv_shared(layer):
                continue
            attn = f"{self.prefix}layers.{layer}.self_attn"
            for kind in "kv":
                name = next((n for n in (f"{attn}.{kind}_scale", f"{attn}.{kind}_proj.{kind}_scale") if n in tensors),
                            None)
                if name is None:
                    return None
                found[f"{kind}_scales"][layer] = load_tensor(tensors[name]).float()
        return found

    @staticmethod
    def unload(model: Gemma4TextModel, part: str) -> None:
        model.get_submodule(part).to("meta")
