"""The demo pair's assistant (scripts/train_demo_pair.py runs it): centroids from the target's embeddings, and
distillation from the frozen target exactly as the runtime drafts (see train_demo_pair.py's docstring)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from demo_target import BOS, EOS, PAD, S, _strip_attn_implementation, adamw, log, lr_at, text_config, windows

# -------------------------------------------------------------------------------------------- assistant

def balanced_kmeans(rows: torch.Tensor, clusters: int, iterations: int, seed: int) -> torch.Tensor:
    """Token ids grouped into `clusters` equal clusters of similar (cosine) rows: a permutation whose
    view(clusters, -1) row c lists cluster c's tokens. Spherical k-means with a capacity-bounded greedy
    assignment (pairs taken best first, each cluster closing at V / clusters tokens)."""
    vocab = rows.shape[0]
    size = vocab // clusters
    x = F.normalize(rows.float(), dim=-1)
    generator = torch.Generator().manual_seed(seed)
    centers = x[torch.randperm(vocab, generator=generator)[:clusters]].clone()
    assignment = torch.zeros(vocab, dtype=torch.long)
    for _ in range(iterations):
        scores = x @ centers.T  # [V, C]
        order = torch.argsort(scores.flatten(), descending=True, stable=True)
        assignment.fill_(-1)
        fill = [0] * clusters
        taken = 0
        for flat in order.tolist():
            token, cluster = divmod(flat, clusters)
            if assignment[token] >= 0 or fill[cluster] >= size:
                continue
            assignment[token] = cluster
            fill[cluster] += 1
            taken += 1
            if taken == vocab:
                break
        centers = F.normalize(torch.zeros(clusters, x.shape[1]).index_add_(0, assignment, x), dim=-1)
    return torch.argsort(assignment, stable=True)


def assistant_config_dict(args, target_folder: Path) -> dict:
    """The assistant's config.json, written by transformers' Gemma4AssistantConfig."""
    from transformers.models.gemma4_assistant import Gemma4AssistantConfig

    target = json.loads((target_folder / "config.json").read_text())
    layers = list(args.assistant_layer_types)
    decoder = text_config(args, num_hidden_layers=len(layers), layer_types=layers, num_kv_shared_layers=len(layers),
                          hidden_size=args.assistant_hidden, intermediate_size=args.assistant_intermediate,
                          num_attention_heads=args.assistant_heads)
    config = Gemma4AssistantConfig(text_config=decoder, backbone_hidden_size=target["hidden_size"],
                                   use_ordered_embeddings=True, num_centroids=args.num_centroids,
                                   centroid_intermediate_top_k=args.centroid_top_k, tie_word_embeddings=True)
    return config.to_dict()


class _Producers:
    """The assistant layers' 'cache': layer i reads the target producer K/V of its attention type."""

    def __init__(self, kv: list[tuple[torch.Tensor, torch.Tensor]]):
        self.kv = kv

    def read(self, layer: int):
        return self.kv[layer]


def strict_causal_masks(config, queries: torch.Tensor, length: int) -> dict[str, torch.Tensor]:
    """`[1, 1, Q, length]` per attention type: draft_mask for each query position (keys strictly before it;
    sliding layers keep sliding_window + 1 of them)."""
    from mtpkit.runtime.assistant import draft_mask

    out = {}
    for layer_type in config.attention:
        window = config.sliding_window if layer_type == S else None
        out[layer_type] = draft_mask(queries, length, window)[:, 0, 0][None, None]  # [1, 1, Q, S]
    return out


def distill_batch(assistant, target, target_config, ids: torch.Tensor, steps: int, weights: list[float]):
    """Loss and greedy agreement per step for windows `ids` [B, T] (see the module docstring)."""
    from mtpkit.runtime import KVCache

    batch, length = ids.shape
    queries = length - steps  # query positions t = 1 .. length - steps
    with torch.no_grad():
        cache = KVCache(target_config, batch, length)
        hidden_t = target(ids, torch.arange(length).expand(batch, -1), cache)
        teacher = target.logits(hidden_t[:, 1:queries + steps]).float()  # position t + j -> index t + j - 1
        embeds = target.embed(ids)
        kv = _Producers([cache.read(source) for source in assistant.check_target(target_config)])
    config = assistant.config
    position = torch.arange(1, queries + 1)
    positions = position.expand(batch, -1)
    masks = strict_causal_masks(config, position, length)
    rope = {t: rotary(positions, torch.float32) for t, rotary in assistant.rotary.items()}
    ordering = assistant.token_ordering
    hidden = hidden_t[:, :queries]  # the target's state at t - 1
    total, agree, centroid_hits = 0.0, [], []
    for j in range(steps):
        x = assistant.pre_projection(torch.cat([embeds[:, 1 + j:1 + j + queries], hidden], dim=-1))
        for i, layer in enumerate(assistant.layers):
            cos, sin = rope[config.layer_types[i]]
            x = layer(x, None, cos, sin, masks[config.layer_types[i]], positions, kv)
        normed = assistant.norm(x)
        hidden = assistant.post_projection(normed)
        logits = F.linear(normed, assistant.lm_head.weight)
        target_logits = teacher[:, j:j + queries]
        p = target_logits.softmax(-1)
        kl = (p * (target_logits.log_softmax(-1) - logits.log_softmax(-1))).sum(-1).mean()
        # The centroid head: the target's distribution summed per centroid.
        clusters = p[..., ordering].view(*p.shape[:-1], assistant.num_centroids, -1).sum(-1)
        centroid_logits = assistant.centroids(normed)
        ckl = (clusters * (clusters.clamp_min(1e-12).log() - centroid_logits.log_softmax(-1))).sum(-1).mean()
        total = total + weights[j] * (kl + ckl)
        with torch.no_grad():
            greedy = target_logits.argmax(-1)
            agree.append((logits.argmax(-1) == greedy).float().mean().item())
            cluster_of = torch.empty_like(ordering)
            cluster_of[ordering] = torch.arange(len(ordering)) // (len(ordering) // assistant.num_centroids)
            top = centroid_logits.topk(assistant.top_k, dim=-1).indices
            centroid_hits.append((top == cluster_of[greedy][..., None]).any(-1).float().mean().item())
    return total / sum(weights), agree, centroid_hits


def init_assistant_from_target(assistant, target, target_config) -> None:
    """Warm start: each assistant layer copies the target layer of its type nearest the end (same shapes),
    the lm_head the target's (tied) embedding table, the final norm the target's."""
    with torch.no_grad():
        if assistant.config.hidden_size != target_config.hidden_size:
            return
        assistant.lm_head.weight.copy_(target.embed_tokens.weight)
        assistant.norm.weight.copy_(target.norm.weight)
        used = set()
        for i in reversed(range(len(assistant.layers))):
            layer_type = assistant.config.layer_types[i]
            source = max(j for j in range(target_config.num_hidden_layers)
                         if target_config.layer_types[j] == layer_type and j not in used)
            used.add(source)
            ours, theirs = assistant.layers[i], target.layers[source]
            if ours.mlp.gate_proj.weight.shape != theirs.mlp.gate_proj.weight.shape or \
                    ours.self_attn.q_proj.weight.shape != theirs.self_attn.q_proj.weight.shape:
                continue
            for name, tensor in ours.state_dict().items():
                if name in theirs.state_dict():
                    tensor.copy_(theirs.state_dict()[name])


def train_assistant(args, config: dict, target, target_config, stream: torch.Tensor) -> tuple:
    from mtpkit.runtime import Gemma4Assistant

    torch.manual_seed(args.seed + 2)
    assistant = Gemma4Assistant(config).float().train()
    init_assistant_from_target(assistant, target, target_config)
    with torch.no_grad():
        ordering = balanced_kmeans(target.embed_tokens.weight, assistant.num_centroids, args.kmeans_iterations,
                                   args.seed)
        assistant.token_ordering.copy_(ordering)
        table = assistant.lm_head.weight[ordering].view(assistant.num_centroids, -1, assistant.config.hidden_size)
        assistant.centroids.weight.copy_(F.normalize(table.mean(1), dim=-1) * table.norm(dim=-1).mean())
    params = [p for p in assistant.parameters() if p.requires_grad]
    optimizer = adamw(params, args.assistant_lr)
    generator = torch.Generator().manual_seed(args.seed + 3)
    weights = args.step_weights[:args.draft_steps]
    start, smooth, smooth_agree, smooth_hits = time.time(), None, None, None
    for step in range(args.assistant_steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args.assistant_steps, args.assistant_lr, args.warmup)
        ids = windows(stream, args.assistant_batch, args.seq_len, generator)
        loss, agree, hits = distill_batch(assistant, target, target_config, ids, args.draft_steps, weights)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        beta = 0.95
        smooth = loss.item() if smooth is None else beta * smooth + (1 - beta) * loss.item()
        smooth_agree = agree if smooth_agree is None else [beta * a + (1 - beta) * b for a, b in zip(smooth_agree, agree)]
        smooth_hits = hits if smooth_hits is None else [beta * a + (1 - beta) * b for a, b in zip(smooth_hits, hits)]
        if step % 25 == 0 or step == args.assistant_steps - 1:
            log(f"assistant step {step}/{args.assistant_steps} loss {smooth:.3f} argmax agreement per step "
                f"{' '.join(f'{a:.3f}' for a in smooth_agree)} centroid top-k hit "
                f"{' '.join(f'{a:.3f}' for a in smooth_hits)} ({time.time() - start:.0f} s)")
    info = {"assistant_train_seconds": round(time.time() - start, 1), "assistant_final_loss": round(smooth, 4),
            "assistant_train_agreement": [round(a, 4) for a in smooth_agree],
            "assistant_train_centroid_hits": [round(a, 4) for a in smooth_hits]}
    return assistant.eval(), info


def checkpoint_tensors(assistant) -> dict[str, torch.Tensor]:
    """Our state dict under the checkpoint names load_assistant_state_dict maps from (its inverse)."""
    out = {}
    for name, tensor in assistant.state_dict().items():
        if name == "lm_head.weight":
            key = "model.embed_tokens.weight"  # tied
        elif name.startswith(("centroids.", "token_ordering")):
            key = "masked_embedding." + name
        elif name.startswith(("pre_projection.", "post_projection.")):
            key = name
        else:
            key = "model." + name
        out[key] = tensor.detach().clone()
    return out


def save_assistant(assistant, config: dict, folder: Path) -> int:
    """Through transformers' Gemma4AssistantForCausalLM (strict), in bfloat16."""
    from transformers import GenerationConfig
    from transformers.models.gemma4_assistant import Gemma4AssistantConfig, Gemma4AssistantForCausalLM

    hf_config = Gemma4AssistantConfig.from_dict(config)
    model = Gemma4AssistantForCausalLM(hf_config)
    tensors = checkpoint_tensors(assistant)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    expected = set(model.state_dict())
    if expected != set(tensors):
        raise RuntimeError(f"names differ: missing {sorted(expected - set(tensors))}, "
                           f"unexpected {sorted(set(tensors) - expected)}")
    model.load_state_dict(tensors, strict=True)
    model = model.to(torch.bfloat16).eval()
    model.generation_config = GenerationConfig(bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD,
                                               num_assistant_tokens=4)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    _strip_attn_implementation(folder)
    return sum(p.numel() for p in model.parameters())


@torch.inference_mode()
def check_batched_equals_runtime(assistant, target, target_config, stream: torch.Tensor, steps: int) -> float:
    """The training forward (all positions at once) against the runtime's Gemma4Assistant.forward, one position
    per row over a KVCache: max abs difference of the draft hidden states over `steps` steps (float32)."""
    from mtpkit.runtime import KVCache

    ids = stream[1000:1000 + 200][None]
    length = ids.shape[1]
    cache = KVCache(target_config, 1, length)
    hidden_t = target(ids, torch.arange(length)[None], cache)
    embeds = target.embed(ids)
    kv = _Producers([cache.read(s) for s in assistant.check_target(target_config)])
    config = assistant.config
    queries = length - steps
    position = torch.arange(1, queries + 1)
    masks = strict_causal_masks(config, position, length)
    rope = {t: r(position[None], torch.float32) for t, r in assistant.rotary.items()}
    hidden, batched = hidden_t[:, :queries], []
    for j in range(steps):
        x = assistant.pre_projection(torch.cat([embeds[:, 1 + j:1 + j + queries], hidden], dim=-1))
        for i, layer in enumerate(assistant.layers):
            x = layer(x, None, *rope[config.layer_types[i]], masks[config.layer_types[i]], position[None], kv)
        hidden = assistant.post_projection(assistant.norm(x))
        batched.append(hidden[0])
    # Each runtime step gets the batched path's previous hidden state, so float rounding (summation order differs
    # between a batch of 1 and of `queries`) is not amplified through the steps.
    worst = 0.0
    for t in (1, 7, 64, 128, 129, 130, 131, queries):
        for j in range(steps):
            h = hidden_t[:, t - 1] if j == 0 else batched[j - 1][t - 1][None]
            h, _ = assistant(embeds[:, t + j], h, torch.tensor([t]), cache, target_config)
            worst = max(worst, (h[0] - batched[j][t - 1]).abs().max().item())
    return worst
