"""What an assistant's tensors say about its dimensions: the evidence that overrides a wrong config.

Each fact is (value, evidence), the evidence naming the tensor and its shape, so a rewrite can say
exactly why it changed a value. Inconsistent tensors (layers that disagree) are refused: no rule
can pick the right value then.
"""

from __future__ import annotations

import re
from typing import Any

from mtpkit.convert.safetensors_file import TensorInfo
from mtpkit.errors import CheckpointError
from mtpkit.formats import gemma4

_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def _shape(info: TensorInfo) -> str:
    return f"{info.name} is {list(info.shape)}"


def layer_count(tensors: dict[str, TensorInfo]) -> int:
    indices = {int(m.group(1)) for name in tensors if (m := _LAYER.match(name))}
    return max(indices) + 1 if indices else 0


def _agreeing(values: dict[int, tuple[int, TensorInfo]], what: str, where: str) -> tuple[int, str]:
    """The one value every layer agrees on, with the first layer's tensor as evidence."""
    distinct = {v for v, _ in values.values()}
    if len(distinct) > 1:
        detail = ", ".join(f"layer {i}: {v}" for i, (v, _) in sorted(values.items()))
        raise CheckpointError(f"layers disagree on {what} ({detail})", where=where,
                              fix="the tensors are inconsistent; restore the original checkpoint")
    first = min(values)
    return values[first][0], _shape(values[first][1])


def shape_facts(text: dict, tensors: dict[str, TensorInfo], where: str) -> dict[str, tuple[Any, str]]:
    """Dimensions the tensors determine, keyed by config field (text_config fields, and assistant top-level ones)."""
    facts: dict[str, tuple[Any, str]] = {}
    embed = tensors.get("model.embed_tokens.weight")
    if embed is not None and len(embed.shape) == 2:
        facts["vocab_size"] = (embed.shape[0], _shape(embed))
        facts["hidden_size"] = (embed.shape[1], _shape(embed))
    num_layers = layer_count(tensors)
    if num_layers:
        facts["num_hidden_layers"] = (num_layers, f"the tensors hold layers 0-{num_layers - 1}")
        _layer_facts(facts, text, tensors, num_layers, where)
    post = tensors.get("post_projection.weight")
    if post is not None and len(post.shape) == 2:
        facts["backbone_hidden_size"] = (post.shape[0], _shape(post))
    centroids = tensors.get("masked_embedding.centroids.weight")
    facts["use_ordered_embeddings"] = (centroids is not None,
                                       "masked_embedding.centroids.weight is " + ("present" if centroids else "absent"))
    if centroids is not None:
        facts["num_centroids"] = (centroids.shape[0], _shape(centroids))
    return facts


def _layer_facts(facts: dict, text: dict, tensors: dict[str, TensorInfo], num_layers: int, where: str) -> None:
    layer_types = gemma4.layer_types_of({**text, "num_hidden_layers": num_layers, "layer_types": text.get("layer_types")},
                                        prefix="text_config.", where=where)
    down = {i: (t.shape[1], t) for i in range(num_layers) if (t := tensors.get(f"model.layers.{i}.mlp.down_proj.weight"))}
    if down:
        facts["intermediate_size"] = _agreeing(down, "the MLP width (mlp.down_proj columns)", where)
    for layer_type, key in (("sliding_attention", "head_dim"), ("full_attention", "global_head_dim")):
        indices = [i for i in range(num_layers) if layer_types[i] == layer_type]
        norms = {i: (t.shape[0], t) for i in indices if (t := tensors.get(f"model.layers.{i}.self_attn.q_norm.weight"))}
        if not norms:
            continue
        head_dim, evidence = _agreeing(norms, f"the {layer_type} head_dim (self_attn.q_norm)", where)
        facts[key] = (head_dim, evidence)
        q_proj = {i: (t.shape[0], t) for i in indices if (t := tensors.get(f"model.layers.{i}.self_attn.q_proj.weight"))}
        if q_proj:
            rows, q_evidence = _agreeing(q_proj, f"the {layer_type} q_proj rows", where)
            if rows % head_dim:
                raise CheckpointError(f"{q_evidence}, not a multiple of the head_dim {head_dim} ({evidence})",
                                      where=where, fix="check layer_types: it may label this layer wrongly")
            facts["num_attention_heads"] = (rows // head_dim, f"{q_evidence} = heads x {head_dim}")
