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
import json
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

# This folder (demo_target, demo_assistant) is on sys.path when the script runs; mtpkit is imported from the repo.
from demo_assistant import assistant_config_dict, check_batched_equals_runtime, save_assistant, train_assistant
from demo_target import (BOS, EOS, FULL, PAD, ROOT, S, TOKENIZER_FILES, encode_stream, heldout_perplexity, log,
                         stdlib_sources, train_target, train_tokenizer)

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
