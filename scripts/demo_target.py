"""The demo pair's data and target (scripts/train_demo_pair.py runs it): the standard library corpus, its BPE
tokenizer, and the Gemma 4 target trained from scratch with transformers' Gemma4ForCausalLM."""

from __future__ import annotations

import hashlib
import json
import math
import sys
import sysconfig
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
