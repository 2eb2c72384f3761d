"""Text in and out of a pair: the target's tokenizer and chat template, prompts, stop conditions, decoding.

The tokenizer comes from the target folder through transformers' AutoTokenizer (never remote code); a pair
without one runs on token ids only. Stop conditions: the target's EOS ids (config.json and
generation_config.json, as transformers' generate stops), plus `stop` entries: token ids, strings that are
one token (stopped on exactly), and longer strings (the text is cut at their first occurrence).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from mtpkit.errors import ConfigError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


def load_tokenizer(folder: Path):
    """The target's tokenizer, or None when the folder ships none."""
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer  # slow import: only when there is a tokenizer to load

    try:
        return AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise ConfigError(f"its tokenizer cannot be loaded ({e})", where=folder,
                          fix="copy the original tokenizer files into the target folder") from None


def eos_token_ids(folder: Path, config: dict) -> list[int]:
    ids = []
    sources = [config, config.get("text_config") or {}]
    generation = folder / "generation_config.json"
    if generation.is_file():
        sources.append(json.loads(generation.read_text(encoding="utf-8")))
    for source in sources:
        value = source.get("eos_token_id")
        ids += value if isinstance(value, list) else [value] if isinstance(value, int) else []
    return sorted(set(ids))


def encode_prompts(prompts, tokenizer, *, chat: bool, vocab_size: int) -> list[list[int]]:
    """A string, a list of strings, a list of ids, or a list of id lists -> id lists."""
    if isinstance(prompts, str) or (prompts and all(isinstance(t, int) for t in prompts)):
        prompts = [prompts]
    if not prompts:
        raise ConfigError("no prompts given", where="prompts", fix="pass a string, a list of strings, or token ids")
    encoded = []
    for prompt in prompts:
        if isinstance(prompt, str):
            if tokenizer is None:
                raise ConfigError("text prompts need the target's tokenizer, and the target folder has none",
                                  where="prompts", fix="copy tokenizer.json into the target folder, or pass token ids")
            if chat:
                ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                    tokenize=True)
                ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
            else:
                ids = tokenizer(prompt)["input_ids"]
        else:
            ids = list(prompt)
        if not ids or not all(isinstance(i, int) and 0 <= i < vocab_size for i in ids):
            raise ConfigError(f"prompt {len(encoded) + 1} must be a non-empty list of token ids in [0, {vocab_size})",
                              where="prompts", fix="check the prompt")
        encoded.append(list(ids))
    return encoded


@dataclass(frozen=True)
class StopRule:
    token_ids: list[int]  # stop right after one of these
    strings: list[str]  # cut the text at the first of these


def stop_rule(stop, tokenizer) -> StopRule:
    entries = [] if stop is None else [stop] if isinstance(stop, (str, int)) else list(stop)
    ids, strings = [], []
    for entry in entries:
        if isinstance(entry, int):
            ids.append(entry)
        elif isinstance(entry, str) and entry:
            single = tokenizer(entry, add_special_tokens=False)["input_ids"] if tokenizer is not None else []
            if len(single) == 1:
                ids.append(single[0])
            else:
                strings.append(entry)
        else:
            raise ConfigError(f"stop entry {entry!r} is neither a token id nor a non-empty string", where="stop",
                              fix="pass strings or token ids")
    return StopRule(ids, strings)


def decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True) if tokenizer is not None else ""


def cut_at_stop(text: str, rule: StopRule) -> tuple[str, bool]:
    """The text up to the first stop string, and whether one was found."""
    cuts = [text.find(s) for s in rule.strings if s in text]
    return (text[:min(cuts)], True) if cuts else (text, False)
