#!/usr/bin/env python
"""Train mtpkit's demo pair: a small Gemma 4 target and its MTP assistant, on the Python standard library.

    python scripts/train_demo_pair.py            # writes mtpkit/demo/{target,assistant,heldout.jsonl}

Seeded and reproducible (same Python version, same torch build, same thread count; CPU only). Stages:

1. Corpus: the *.py files under sysconfig's stdlib folder, in sorted order, without site-packages, the test
   suites and generated tables (encodings, pydoc_data). A file is held out when sha256(relative path) % 16 == 0.
2. Tokenizer: byte-level BPE (tokenizers), 4096 tokens; <pad> 0, <eos> 1, <bos> 2, <unk> 3 (Gemma's ids).
3. Target: transformers' Gemma4ForCausalLM (gemma4_text), trained from scratch on windows of the training
   stream (each file is <bos> text <eos>), saved in bfloat16 with save_pretrained.
4. Assistant: mtpkit's runtime Gemma4Assistant, distilled from the frozen target exactly as the runtime drafts
   (see distill_batch), exported under transformers' Gemma4AssistantForCausalLM names and saved by transformers.
5. Held-out prompts, and the acceptance the runtime measures on them (mtpkit.load_pair, greedy).

Distillation, batched: one frozen target forward over B windows of T tokens fills a KVCache holding every
position. A draft query at position t reads the producer layers' K/V of the positions before t only
(assistant.draft_mask: t - s > 0, and <= sliding_window + 1 on sliding layers), and that set depends on t alone,
never on the step: the runtime holds the position constant over a round. So every position of a window drafts
at once, as a [B, T] block of queries over the whole window's K/V with a strictly causal (shifted) mask: no
per-position cache copies. Step j (0-based) of the query at t takes the target's scaled embedding of the token
at t + j and, as hidden state, the target's final-norm state at t - 1 (j = 0) or the previous step's
post_projection output, and is trained towards the target's next-token distribution at t + j (KL), plus the
centroid head towards that distribution summed per centroid. The inputs are the data's tokens (teacher forcing);
the labels are the target's, so the assistant learns the target's conditional, not the data's.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import shutil
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

S, FULL = "sliding_attention", "full_attention"
SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>"]  # ids 0, 1, 2, 3
PAD, EOS, BOS = 0, 1, 2
SKIP_DIRS = {"site-packages", "test", "tests", "idle_test", "encodings", "pydoc_data", "__pycache__"}
HELDOUT_MOD = 16
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


# ----------------------------------------------------------------------------------------------- corpus

def stdlib_sources() -> tuple[dict[str, str], dict[str, str]]:
    """(train, held out): relative path -> source text, in sorted path order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    train, heldout = {}, {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if set(rel.parts[:-1]) & SKIP_DIRS or rel.parts[0].startswith("config-") or rel.name.startswith(
                "_sysconfigdata"):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        key = rel.as_posix()
        held = int(hashlib.sha256(key.encode()).hexdigest(), 16) % HELDOUT_MOD == 0
        (heldout if held else train)[key] = text
    return train, heldout


# -------------------------------------------------------------------------------------------- tokenizer

def train_tokenizer(texts: list[str], vocab_size: int, folder: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    assert [tokenizer.token_to_id(t) for t in SPECIAL] == [0, 1, 2, 3], "special tokens moved"
    assert tokenizer.get_vocab_size() == vocab_size
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    special = {"pad_token": "<pad>", "eos_token": "<eos>", "bos_token": "<bos>", "unk_token": "<unk>"}
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", **special, "add_bos_token": False, "add_eos_token": False,
        "clean_up_tokenization_spaces": False, "model_max_length": 4096}, indent=2) + "\n")
    (folder / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    return tokenizer


def encode_stream(tokenizer, texts: list[str]) -> torch.Tensor:
    """Every file as <bos> text <eos>, concatenated."""
    ids = []
    for encoding in tokenizer.encode_batch(texts, add_special_tokens=False):
        ids += [BOS, *encoding.ids, EOS]
    return torch.tensor(ids, dtype=torch.long)


# ----------------------------------------------------------------------------------------------- target

def text_config(args, **overrides):
    """A Gemma4TextConfig: the target's, or (overrides) the assistant's decoder, which shares its head geometry,
    sliding window, RoPE and norm epsilon (it attends over the target's K/V at the target's positions)."""
    from transformers import Gemma4TextConfig

    kwargs = dict(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=len(args.layer_types), layer_types=list(args.layer_types),
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
        global_head_dim=args.global_head_dim, sliding_window=args.sliding_window,
        max_position_embeddings=4096, hidden_size_per_layer_input=0, vocab_size_per_layer_input=0,
        final_logit_softcapping=30.0, tie_word_embeddings=True, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=BOS,
        num_kv_shared_layers=0)
    return Gemma4TextConfig(**(kwargs | overrides))


def target_config(args):
    return text_config(args)


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def windows(stream: torch.Tensor, batch: int, length: int, generator: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(stream) - length, (batch,), generator=generator)
    return torch.stack([stream[s:s + length] for s in starts.tolist()])


def adamw(params, lr: float):
    decay = [p for p in params if p.ndim >= 2]
    other = [p for p in params if p.ndim < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95), eps=1e-8)


def train_target(args, stream: torch.Tensor, folder: Path) -> dict:
    from transformers import Gemma4ForCausalLM, GenerationConfig

    torch.manual_seed(args.seed)
    config = target_config(args)
    config._attn_implementation = "sdpa"
    model = Gemma4ForCausalLM(config).train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = adamw(params, args.target_lr)
    generator = torch.Generator().manual_seed(args.seed + 1)
    start, seen, smooth = time.time(), 0, None
    for step in range(args.target_steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args.target_steps, args.target_lr, args.warmup)
        ids = windows(stream, args.batch, args.seq_len, generator)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        seen += ids.numel()
        smooth = loss.item() if smooth is None else 0.98 * smooth + 0.02 * loss.item()
        if step % 50 == 0 or step == args.target_steps - 1:
            rate = seen / (time.time() - start)
            log(f"target step {step}/{args.target_steps} loss {smooth:.3f} ({rate:.0f} tokens/s)")
    folder.mkdir(parents=True, exist_ok=True)
    model = model.to(torch.bfloat16).eval()
    model.config._attn_implementation = "eager"
    model.generation_config = GenerationConfig(bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)
    model.save_pretrained(folder, safe_serialization=True)
    _strip_attn_implementation(folder)
    return {"target_params": sum(p.numel() for p in model.parameters()), "target_tokens_seen": seen,
            "target_train_seconds": round(time.time() - start, 1), "target_final_loss": round(smooth, 4)}


def _strip_attn_implementation(folder: Path) -> None:
    path = folder / "config.json"
    data = json.loads(path.read_text())
    for holder in (data, data.get("text_config") or {}):
        holder.pop("_attn_implementation", None)
        holder.pop("attn_implementation", None)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


@torch.inference_mode()
def heldout_perplexity(target, config, stream: torch.Tensor, length: int, batch: int = 16) -> tuple[float, int]:
    """Perplexity of the runtime target (the shipped bf16 weights) over non-overlapping windows of the held-out
    stream; every token but each window's first is scored."""
    from mtpkit.runtime import KVCache

    usable = (len(stream) // length) * length
    rows = stream[:usable].view(-1, length)
    total, count = 0.0, 0
    for i in range(0, len(rows), batch):
        ids = rows[i:i + batch]
        positions = torch.arange(length).expand(len(ids), -1)
        hidden = target(ids, positions, KVCache(config, len(ids), length))
        logits = target.logits(hidden[:, :-1]).float()
        total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum").item()
        count += ids[:, 1:].numel()
    return math.exp(total / count), count


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


# ---------------------------------------------------------------------------------------------- prompts

def heldout_prompts(heldout: dict[str, str], count: int, per_file: int = 2) -> list[dict]:
    """The first lines of held-out functions: the def line(s) through the first line of the docstring (at most
    `per_file` a file, in sorted file order, then source order)."""
    picked = []
    for path, text in heldout.items():
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        lines = text.splitlines()
        taken = 0
        for node in ast.walk(tree):
            if taken >= per_file:
                break
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or ast.get_docstring(node) is None:
                continue
            doc = node.body[0]
            prompt = "\n".join(lines[node.lineno - 1:doc.lineno])
            first_doc_line = lines[doc.lineno - 1].strip().lstrip("rRbBuU").strip("\"'")
            if doc.lineno - node.lineno > 3 or len(first_doc_line) < 8 or not 20 <= len(prompt) <= 240:
                continue
            picked.append({"prompt": prompt, "source": f"{path}:{node.lineno}"})
            taken += 1
    picked.sort(key=lambda p: (p["source"].split(":")[0], int(p["source"].split(":")[1])))
    # Spread over the files: every file's first function before any file's second.
    firsts, seconds, seen = [], [], set()
    for p in picked:
        (seconds if p["source"].split(":")[0] in seen else firsts).append(p)
        seen.add(p["source"].split(":")[0])
    return (firsts + seconds)[:count]


def measure(target_folder: Path, assistant_folder: Path, prompts: list[str], max_new_tokens: int) -> dict:
    import mtpkit

    pair = mtpkit.load_pair(target=target_folder, draft=assistant_folder, dtype="float32", device="cpu")
    reference = pair.generate(prompts, max_new_tokens=max_new_tokens, num_speculative_tokens=0)
    out = {}
    for k in (1, 2, 3, 4):
        start = time.time()
        results = pair.generate(prompts, max_new_tokens=max_new_tokens, num_speculative_tokens=k)
        stats = results[0].stats
        same = all(a.token_ids == b.token_ids for a, b in zip(results, reference))
        out[k] = {"acceptance_per_position": [round(a, 4) for a in stats.acceptance_rate_per_position],
                  "mean_acceptance_length": round(stats.mean_acceptance_length, 4),
                  "outputs_equal_target_only": same, "seconds": round(time.time() - start, 2)}
        log(f"k={k}: per position {out[k]['acceptance_per_position']} mean length "
            f"{out[k]['mean_acceptance_length']} equal to target-only: {same}")
        if not same:
            raise RuntimeError(f"k={k}: speculative output differs from target-only output")
    return out


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


# ------------------------------------------------------------------------------------------------- main

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "mtpkit" / "demo")
    p.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temporary one)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reuse-target", action="store_true",
                   help="skip stages 1-3 when WORK already holds a target (for iterating on the assistant)")
    # tokenizer + target
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--layer-types", nargs="+", default=[S, S, FULL, S, S, FULL])
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=1)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--global-head-dim", type=int, default=128)
    p.add_argument("--sliding-window", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--target-steps", type=int, default=1200)
    p.add_argument("--target-lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=50)
    # assistant
    p.add_argument("--assistant-layer-types", nargs="+", default=[S, FULL])
    p.add_argument("--assistant-hidden", type=int, default=256)
    p.add_argument("--assistant-intermediate", type=int, default=768)
    p.add_argument("--assistant-heads", type=int, default=4)
    p.add_argument("--num-centroids", type=int, default=64)
    p.add_argument("--centroid-top-k", type=int, default=8)
    p.add_argument("--kmeans-iterations", type=int, default=8)
    p.add_argument("--draft-steps", type=int, default=4)
    p.add_argument("--step-weights", type=float, nargs="+", default=[1.0, 0.8, 0.6, 0.5])
    p.add_argument("--assistant-batch", type=int, default=8)
    p.add_argument("--assistant-steps", type=int, default=300)
    p.add_argument("--assistant-lr", type=float, default=1.5e-3)
    # evaluation
    p.add_argument("--prompts", type=int, default=48)
    p.add_argument("--max-new-tokens", type=int, default=64)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    began = time.time()
    work = args.work or Path(tempfile.mkdtemp(prefix="mtpkit-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    target_dir, assistant_dir = work / "target", work / "assistant"
    report: dict = {"command": " ".join(["python", "scripts/train_demo_pair.py", *(argv or sys.argv[1:])]),
                    "seed": args.seed, "threads": args.threads, "python": sys.version.split()[0],
                    "torch": torch.__version__}

    train, heldout = stdlib_sources()
    report |= {"train_files": len(train), "heldout_files": len(heldout),
               "train_chars": sum(map(len, train.values())), "heldout_chars": sum(map(len, heldout.values()))}
    log(f"corpus: {len(train)} training files, {len(heldout)} held out, {report['train_chars'] / 1e6:.1f}M chars")
    from tokenizers import Tokenizer

    if args.reuse_target and (target_dir / "model.safetensors").is_file():
        tokenizer = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
        previous = json.loads((work / "report.json").read_text()) if (work / "report.json").is_file() else {}
        report |= {k: v for k, v in previous.items() if k.startswith(("target_", "heldout_perplexity", "tokens_"))}
    else:
        tokenizer = train_tokenizer(list(train.values()), args.vocab, target_dir)
        log("tokenizer trained")
    train_stream = encode_stream(tokenizer, list(train.values()))
    heldout_stream = encode_stream(tokenizer, list(heldout.values()))
    report |= {"tokens_train": len(train_stream), "tokens_heldout": len(heldout_stream)}
    log(f"tokens: {len(train_stream)} training, {len(heldout_stream)} held out")

    if not (args.reuse_target and (target_dir / "model.safetensors").is_file()):
        report |= train_target(args, train_stream, target_dir)
    from transformers import AutoTokenizer

    hf_tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    assert (hf_tokenizer.bos_token_id, hf_tokenizer.eos_token_id, hf_tokenizer.pad_token_id) == (BOS, EOS, PAD)

    from mtpkit.loader import load_target

    loaded = load_target(target_dir, device="cpu", dtype="float32")
    target, target_config = loaded.model, loaded.config
    for p in target.parameters():
        p.requires_grad_(False)
    if "heldout_perplexity" not in report:
        ppl, scored = heldout_perplexity(target, target_config, heldout_stream, args.seq_len)
        report |= {"heldout_perplexity": round(ppl, 3), "heldout_tokens_scored": scored,
                   "heldout_bits_per_char": round(math.log2(ppl) * scored / report["heldout_chars"], 4)}
        log(f"held-out perplexity {ppl:.3f} over {scored} tokens")
    (work / "report.json").write_text(json.dumps(report, indent=2) + "\n")

    config = assistant_config_dict(args, target_dir)
    assistant, info = train_assistant(args, config, target, target_config, train_stream)
    report |= info
    with torch.no_grad():
        report["batched_vs_runtime_max_abs_diff"] = check_batched_equals_runtime(
            assistant, target, target_config, train_stream, args.draft_steps)
    log(f"training forward vs runtime forward: max |diff| {report['batched_vs_runtime_max_abs_diff']:.2e}")
    if report["batched_vs_runtime_max_abs_diff"] > 1e-4:
        raise RuntimeError("the batched training forward does not match the runtime's draft steps")
    report["assistant_params"] = save_assistant(assistant, config, assistant_dir)
    for name in TOKENIZER_FILES:
        shutil.copy2(target_dir / name, assistant_dir / name)

    from transformers import Gemma4ForCausalLM
    from transformers.models.gemma4_assistant import Gemma4AssistantForCausalLM

    Gemma4ForCausalLM.from_pretrained(target_dir)
    Gemma4AssistantForCausalLM.from_pretrained(assistant_dir)

    prompts = heldout_prompts(heldout, args.prompts)
    (work / "heldout.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    report["heldout_prompts"] = len(prompts)
    report["acceptance"] = measure(target_dir, assistant_dir, [p["prompt"] for p in prompts], args.max_new_tokens)
    report["acceptance_first_4_prompts_k4"] = measure(target_dir, assistant_dir, [p["prompt"] for p in prompts[:4]],
                                                      args.max_new_tokens)[4]

    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    for name in ("target", "assistant"):
        if (out / name).exists():
            shutil.rmtree(out / name)
        shutil.copytree(work / name, out / name)
    shutil.copy2(work / "heldout.jsonl", out / "heldout.jsonl")
    report["target_bytes"] = folder_bytes(out / "target")
    report["assistant_bytes"] = folder_bytes(out / "assistant")
    report["total_seconds"] = round(time.time() - began, 1)
    (work / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    log(json.dumps(report, indent=2))
    log(f"done in {report['total_seconds']:.0f} s; wrote {out}")


if __name__ == "__main__":
    main()
