"""The Gemma 4 MTP assistant (drafter), numerically equal to transformers' Gemma4AssistantForCausalLM.

One draft step (transformers' SinglePositionMultiTokenCandidateGenerator): pre_projection of
[target embedding of the last token, target hidden state] -> decoder layers whose attention has only
queries and reads the target's K/V (its producer layer of each attention type) -> final norm ->
post_projection gives the hidden state fed back into the next step; the tied lm_head (or the
centroid-masked embedder) gives the logits. The position stays that of the last token over a round.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from mtpkit.errors import ConfigError
from mtpkit.formats.gemma4 import assistant_fields, get_int, role_of, text_config_of
from mtpkit.runtime.config import TextConfig
from mtpkit.runtime.kv_cache import KVCache
from mtpkit.runtime.layers import RMSNorm
from mtpkit.runtime.model import DecoderLayer
from mtpkit.runtime.rope import RotaryEmbedding


def assistant_text_config(config: dict, where: str = "config.json") -> TextConfig:
    """The assistant decoder's TextConfig, from the assistant's config.json dict (text_config nested).

    Every assistant layer is KV-shared (transformers sets num_kv_shared_layers to num_hidden_layers
    when it is 0 or absent). TextConfig.from_dict refuses a config without a K/V-computing layer,
    so it parses the decoder as unshared and the sharing is set afterwards; kv_source stays the
    identity and is never used: the assistant reads the target's cache (see _ProducerCache).
    """
    if role_of(config, where) != "assistant":
        raise ConfigError(f"model_type {config.get('model_type')!r} is a target, not an assistant", where=where,
                          fix="pass the assistant's config.json")
    text, prefix = text_config_of(config, where)
    if not prefix:
        raise ConfigError("text_config is missing", where=where, fix="an assistant nests its decoder in text_config")
    layers = get_int(text, "num_hidden_layers", prefix=prefix, where=where, minimum=1)
    shared = get_int(text, "num_kv_shared_layers", prefix=prefix, where=where, default=0) or layers
    if shared != layers:
        raise ConfigError(f"{prefix}num_kv_shared_layers is {shared}, but every assistant layer must be KV-shared "
                          f"({prefix}num_hidden_layers is {layers})", where=where,
                          fix="restore num_kv_shared_layers from the original config")
    parsed = TextConfig.from_dict({**config, "text_config": {**text, "num_kv_shared_layers": 0}}, where)
    # transformers' Gemma4AssistantConfig.validate_architecture refuses the same.
    if parsed.hidden_size_per_layer_input or parsed.enable_moe_block or parsed.use_double_wide_mlp:
        raise ConfigError("an assistant has no per-layer inputs, MoE block or double-wide MLP", where=where,
                          fix=f"set {prefix}hidden_size_per_layer_input to 0, enable_moe_block and "
                              "use_double_wide_mlp to false")
    return dataclasses.replace(parsed, num_kv_shared_layers=layers)


def kv_producers_of(config: TextConfig) -> dict[str, int]:
    """Per attention type, the target layer the assistant reads: the last non-KV-shared one of the
    type (transformers' kv_sharing_modes "store"; formats.gemma4.kv_producers from a dict)."""
    return {config.layer_types[i]: i for i in range(config.first_kv_shared_layer)}  # later layers win


def draft_mask(position: torch.Tensor, max_len: int, sliding_window: int | None = None,
               key_positions: torch.Tensor | None = None) -> torch.Tensor:
    """Boolean `[B, 1, 1, S]`: the target cache keys a draft query at `position` `[B]` attends.

    Keys are the cache slots (slot s holds position s) unless `key_positions` `[B, S]` names them (a
    sliding ring's view; -1 for none). Keys strictly before the position: the token at `position` is not
    in the target's cache yet (its slot may hold a rejected draft), as in transformers' first draft round,
    where the shared K/V are the prompt's. Sliding layers see the last sliding_window + 1 of those:
    transformers builds this mask bidirectionally, |q - kv| <= window (inclusive), then flips it onto the
    most recent slots, so it keeps one slot more than the target's own causal window.
    """
    if key_positions is None:
        key_positions = torch.arange(max_len, device=position.device)[None]
    distance = position[:, None, None, None] - key_positions[:, None, None, :]
    allowed = (distance > 0) & (key_positions[:, None, None, :] >= 0)
    if sliding_window is not None:
        allowed = allowed & (distance <= sliding_window + 1)
    return allowed


class _ProducerCache:
    """What the assistant's attention layers read as their cache: assistant layer i gets the target's
    cache of the producer layer of layer i's attention type (Attention.forward calls read(i)).
    Going through KVCache.read gives an FP8 cache's values dequantized with the producer's scales."""

    def __init__(self, cache: KVCache, sources: list[int]):
        self.cache, self.sources = cache, sources

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cache.read(self.sources[layer])


class Gemma4Assistant(nn.Module):
    def __init__(self, config: dict, where: str = "config.json"):
        super().__init__()
        self.config = text = assistant_text_config(config, where)
        fields = assistant_fields(config)
        defaults = {"backbone_hidden_size": 1536, "use_ordered_embeddings": False, "num_centroids": 2048,
                    "centroid_intermediate_top_k": 32, "tie_word_embeddings": True}  # Gemma4AssistantConfig's
        fields = {key: defaults[key] if value is None else value for key, value in fields.items()}
        self.backbone_hidden_size = get_int(fields, "backbone_hidden_size", where=where, minimum=1)
        self.use_ordered_embeddings = bool(fields["use_ordered_embeddings"])
        self.tie_word_embeddings = bool(fields["tie_word_embeddings"])
        hidden, vocab = text.hidden_size, text.vocab_size

        self.pre_projection = nn.Linear(2 * self.backbone_hidden_size, hidden, bias=False)
        self.layers = nn.ModuleList(DecoderLayer(text, i) for i in range(text.num_hidden_layers))
        self.norm = RMSNorm(hidden, text.rms_norm_eps)
        self.post_projection = nn.Linear(hidden, self.backbone_hidden_size, bias=False)
        # The checkpoint's model.embed_tokens.weight when tied: the assistant never embeds tokens
        # itself (its input is the target's embedding), so the table serves only as the lm_head.
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.rotary = nn.ModuleDict({t: RotaryEmbedding(spec) for t, spec in text.attention.items()})
        if self.use_ordered_embeddings:
            self.num_centroids = get_int(fields, "num_centroids", where=where, minimum=1)
            self.top_k = get_int(fields, "centroid_intermediate_top_k", where=where, minimum=1,
                                 maximum=self.num_centroids)
            if vocab % self.num_centroids:
                raise ConfigError(f"vocab_size {vocab} is not a multiple of num_centroids {self.num_centroids}",
                                  where=where, fix="restore num_centroids from the original config")
            self.centroids = nn.Linear(hidden, self.num_centroids, bias=False)
            # Row c of token_ordering.view(num_centroids, -1) lists the token ids of centroid c.
            self.register_buffer("token_ordering", torch.zeros(vocab, dtype=torch.long))
            # lm_head's rows in centroid order, [num_centroids, tokens per centroid, hidden] (order_rows):
            # the top-k centroids' rows are then k contiguous blocks, not k * V / C scattered rows.
            self.register_buffer("ordered_rows", None, persistent=False)

    @classmethod
    def skeleton(cls, config: dict, where: str = "config.json") -> Gemma4Assistant:
        """The assistant with its parameters on the meta device, for load_assistant_state_dict(assign=True);
        the computed RoPE buffers are real."""
        with torch.device("meta"):
            model = cls(config, where)
        model.rotary = nn.ModuleDict({t: RotaryEmbedding(spec) for t, spec in model.config.attention.items()})
        return model

    def check_target(self, target: TextConfig) -> list[int]:
        """The target layer each assistant layer reads; ValueError if the pair cannot work together."""
        producers = kv_producers_of(target)
        if target.hidden_size != self.backbone_hidden_size:
            raise ValueError(f"target hidden_size {target.hidden_size} != backbone_hidden_size "
                             f"{self.backbone_hidden_size}")
        sources = []
        for layer, layer_type in enumerate(self.config.layer_types):
            if layer_type not in producers:
                raise ValueError(f"assistant layer {layer} is {layer_type}, which the target has no layer of")
            ours, theirs = self.config.spec(layer), target.spec(producers[layer_type])
            if ours.head_dim != theirs.head_dim or self.config.num_attention_heads % theirs.num_key_value_heads:
                raise ValueError(f"assistant layer {layer} ({self.config.num_attention_heads} heads of "
                                 f"{ours.head_dim}) cannot read target layer {producers[layer_type]} "
                                 f"({theirs.num_key_value_heads} KV heads of {theirs.head_dim})")
            sources.append(producers[layer_type])
        return sources

    def forward(self, token_embedding: torch.Tensor, hidden: torch.Tensor, position: torch.Tensor,
                target_cache: KVCache, target_config: TextConfig) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step for each row: `(draft_hidden [B, H_target], normed [B, H])`.

        token_embedding: the target's scaled embedding (Gemma4TextModel.embed) of the last token, the
        one at `position` `[B]` (>= 1); hidden: the target's final-norm hidden state of the token
        before it, or the previous step's draft_hidden. Attends the target's cache slots before
        `position` (draft_mask). draft_hidden is fed back as the next `hidden`; `normed` goes to
        logits() or greedy().
        """
        config = self.config
        kv = _ProducerCache(target_cache, self.check_target(target_config))
        x = torch.cat([token_embedding, hidden], dim=-1).to(self.pre_projection.weight.dtype)
        x = self.pre_projection(x)[:, None]  # [B, 1, H]: one query per row
        positions = position[:, None]
        masks = {t: draft_mask(position, target_cache.max_len, config.sliding_window if t == "sliding_attention"
                               else None, target_cache.key_positions(t)) for t in config.attention}
        rope = {t: rotary(positions, x.dtype) for t, rotary in self.rotary.items()}
        for i, layer in enumerate(self.layers):
            layer_type = config.layer_types[i]
            x = layer(x, None, *rope[layer_type], masks[layer_type], positions, kv)
        normed = self.norm(x)[:, 0]
        return self.post_projection(normed), normed

    def order_rows(self) -> None:
        """Build `ordered_rows` from lm_head and token_ordering (load_assistant_state_dict does; call it again
        after changing either). It is a second copy of the table (for E2B's assistant 262144 x 256: 128 MiB
        in bf16), bought for speed: the centroid path reads contiguous blocks instead of scattered rows."""
        if self.use_ordered_embeddings:
            rows = self.lm_head.weight.detach()[self.token_ordering]
            self.ordered_rows = rows.view(self.num_centroids, -1, rows.shape[-1])

    def _selected(self, normed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids `[B, top_k * tokens_per_centroid]` of the top-k centroids, and their logits."""
        _, top = torch.topk(self.centroids(normed), self.top_k, dim=-1)
        tokens = self.token_ordering.view(self.num_centroids, -1)[top].flatten(1)
        if self.ordered_rows is not None:  # [B, n, H]: k contiguous blocks of the ordered table
            rows = torch.index_select(self.ordered_rows, 0, top.flatten()).view(*tokens.shape, -1)
        else:
            rows = self.lm_head.weight[tokens]  # only the selected rows of the table, gathered one by one
        return tokens, (normed[:, None, :] @ rows.transpose(-1, -2))[:, 0]  # transformers' batched matmul

    def logits(self, normed: torch.Tensor, fill: float | None = None) -> torch.Tensor:
        """Full-vocabulary logits `[B, V]` as transformers computes them (no final softcapping there).

        Ordered embeddings: tokens outside the top-k centroids get `fill`, by default each row's
        smallest selected logit minus 1 (transformers takes that minimum over the whole batch, but
        generate runs batch 1; per row keeps rows independent). Softmax then gives masked tokens a
        small non-zero probability, as in transformers; pass fill=-inf for none.
        """
        if not self.use_ordered_embeddings:
            return F.linear(normed, self.lm_head.weight)
        tokens, selected = self._selected(normed)
        base = selected.min(-1, keepdim=True).values - 1.0 if fill is None else selected.new_full((1, 1), fill)
        return base.expand(normed.shape[0], self.config.vocab_size).scatter(-1, tokens, selected)

    def greedy(self, normed: torch.Tensor) -> torch.Tensor:
        """The argmax token id `[B]`; with ordered embeddings, over the top-k centroids' tokens only,
        never materialising the full-vocabulary logits (same token as logits().argmax unless tied)."""
        if not self.use_ordered_embeddings:
            return self.logits(normed).argmax(-1)
        tokens, selected = self._selected(normed)
        return tokens.gather(-1, selected.argmax(-1, keepdim=True))[:, 0]

    def step(self, token_embedding: torch.Tensor, hidden: torch.Tensor, position: torch.Tensor,
             target_cache: KVCache, target_config: TextConfig) -> tuple[torch.Tensor, torch.Tensor]:
        """A greedy draft step: `(draft_hidden [B, H_target], token ids [B])`."""
        draft_hidden, normed = self(token_embedding, hidden, position, target_cache, target_config)
        return draft_hidden, self.greedy(normed)


def load_assistant_state_dict(model: Gemma4Assistant, tensors: dict[str, torch.Tensor], *,
                              assign: bool = False, dtype: torch.dtype | None = None,
                              device: torch.device | str | None = None) -> None:
    """Copy an assistant checkpoint's `tensors` into `model`, cast to its dtype, strictly.

    `assign` (a Gemma4Assistant.skeleton): the tensors become the parameters instead, floating ones cast to
    `dtype` and everything moved to `device` one tensor at a time (no second copy of the model).

    Missing or unexpected tensors, or a wrong shape, raise ValueError with the checkpoint names. A
    tied lm_head is model.embed_tokens.weight (a stray lm_head.weight is ignored); an untied one is
    lm_head.weight, and the unused model.embed_tokens.weight is then ignored. token_ordering must be
    a permutation of the vocabulary (the masked embedder scatters logits to it).
    """
    lm_head, ignored = ("model.embed_tokens.weight", "lm_head.weight") if model.tie_word_embeddings else (
        "lm_head.weight", "model.embed_tokens.weight")

    def checkpoint_name(ours: str) -> str:
        if ours == "lm_head.weight":
            return lm_head
        if ours.startswith(("centroids.", "token_ordering")):
            return "masked_embedding." + ours
        return ours if ours.startswith(("pre_projection.", "post_projection.")) else "model." + ours

    expected = model.state_dict()
    names = {checkpoint_name(ours): ours for ours in expected}
    missing = [name for name in names if name not in tensors]
    unexpected = [name for name in tensors if name not in names and name != ignored]
    if missing or unexpected:
        raise ValueError(f"assistant tensors do not match the config: missing {sorted(missing)}, "
                         f"unexpected {sorted(unexpected)}")
    wrong = [f"{name} {tuple(tensors[name].shape)} (expected {tuple(expected[ours].shape)})"
             for name, ours in names.items() if tensors[name].shape != expected[ours].shape]
    if wrong:
        raise ValueError(f"assistant tensors have the wrong shape: {', '.join(wrong)}")
    if model.use_ordered_embeddings:
        ordering = tensors["masked_embedding.token_ordering"]
        if not torch.equal(ordering.long().sort().values, torch.arange(ordering.numel(), device=ordering.device)):
            raise ValueError("masked_embedding.token_ordering is not a permutation of the vocabulary")
    state = {ours: tensors[name] for name, ours in names.items()}
    if assign:
        state = {name: t.to(device=device, dtype=dtype if dtype is not None and t.is_floating_point() else t.dtype)
                 for name, t in state.items()}
        model.rotary.to(device)
    model.load_state_dict(state, strict=True, assign=assign)
    model.order_rows()
