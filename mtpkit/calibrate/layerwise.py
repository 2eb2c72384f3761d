"""Run calibration samples through a target one decoder layer at a time, so memory holds one layer.

Each sample runs alone (batch 1, positions 0..T-1, no padding), so every token it writes is a real one.
The KV cache is lazy: an owning layer's storage exists from its own layer until the last layer that reads
it (KV-shared layers of E2B / E4B read an earlier layer's cache), then it is released.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from mtpkit.loader.text_parts import TextCheckpoint
from mtpkit.runtime import KVCache

# Called with (layer index, the loaded layer); returns hook handles removed once the layer has run.
LayerHook = Callable[[int, nn.Module], list]


class LayerwiseStream:
    """The hidden states of every sample, advanced layer by layer through one checkpoint."""

    def __init__(self, text: TextCheckpoint, sequences: Sequence[torch.Tensor], *,
                 cache_factory: Callable[..., KVCache] = KVCache, cache_kwargs: dict | None = None):
        self.text, self.config = text, text.config
        self.model = text.skeleton()
        text.load_outer(self.model)
        kwargs = {"dtype": text.dtype, **(cache_kwargs or {})}
        self.caches = [cache_factory(self.config, 1, len(s), lazy=True, **kwargs) for s in sequences]
        self.sequences = list(sequences)
        with torch.inference_mode():
            self.inputs = [self.model.prepare(s[None], torch.arange(len(s))[None], cache)
                           for s, cache in zip(sequences, self.caches)]
        self.hidden = [inputs.embeds for inputs in self.inputs]
        # The last layer that reads each owning layer's cache: after it, the storage can go.
        self.last_reader = {source: layer for layer, source in enumerate(self.config.kv_source)}

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @torch.inference_mode()
    def run_layer(self, i: int, hook: LayerHook | None = None) -> None:
        part = f"layers.{i}"
        self.text.load(self.model, part)
        handles = hook(i, self.model.layers[i]) if hook else []
        try:
            for b, cache in enumerate(self.caches):
                cache.allocate(i)
                self.hidden[b] = self.model.run_layer(i, self.hidden[b], self.inputs[b], cache)
        finally:
            for handle in handles:
                handle.remove()
        self.text.unload(self.model, part)
        for source, last in self.last_reader.items():
            if last == i:
                for cache in self.caches:
                    cache.release(source)

    @torch.inference_mode()
    def logits(self, b: int) -> torch.Tensor:
        """Float32 logits `[T, vocab]` of sample b, after every layer has run."""
        return self.model.logits(self.model.norm(self.hidden[b]))[0].float()
