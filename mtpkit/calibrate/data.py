"""Calibration inputs: sample text (or token ids) turned into the token sequences the forward passes run.

`--calib FILE` is plain text (samples separated by blank lines) or JSONL (one object per line with
`"text"` or `"input_ids"`); without it, mtpkit's own small set ships in the package
(default_calibration.jsonl: prose, code, math, dialogue, data and eight languages). Text is tokenized
with the target's own `tokenizer.json` (the `tokenizers` library: no remote code, no pickles), starting
each sample with the model's BOS token as the chat template does. What was used is described for the
report: the file and its sha256, the number of samples and of tokens.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from mtpkit.errors import ConfigError, SourceNotFoundError

DEFAULT_SET = "default_calibration.jsonl"
DEFAULT_MAX_TOKENS = 256


@dataclass(frozen=True)
class CalibrationSet:
    sequences: list[torch.Tensor]  # 1-D int64 token ids, one per sample
    description: dict  # for the report: source, sha256, samples, tokens, max_tokens_per_sample

    @property
    def tokens(self) -> int:
        return sum(len(s) for s in self.sequences)


def _records(path: Path, text: str) -> list[dict]:
    if path.suffix == ".jsonl":
        records = []
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"line {number} is not JSON ({e.msg})", where=str(path),
                                  fix='write one object per line: {"text": "..."} or {"input_ids": [...]}') from None
            if not isinstance(record, dict) or not ({"text", "input_ids"} & record.keys()):
                raise ConfigError(f"line {number} has neither \"text\" nor \"input_ids\"", where=str(path),
                                  fix='write one object per line: {"text": "..."} or {"input_ids": [...]}')
            records.append(record)
        return records
    return [{"text": block.strip()} for block in text.split("\n\n") if block.strip()]


def _tokenizer(folder: Path, where: str):
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise ConfigError(f"calibration text needs the target's tokenizer, and {path} does not exist", where=where,
                          fix="copy tokenizer.json into the target folder, or give --calib a JSONL file of input_ids")
    from tokenizers import Tokenizer  # a transformers dependency; imported only when text is tokenized

    return Tokenizer.from_file(str(path))


def load_calibration_set(calib: str | Path | None, target_folder: Path, config: dict, *,
                         max_samples: int | None = None, max_tokens: int = DEFAULT_MAX_TOKENS) -> CalibrationSet:
    """Read, tokenize and truncate the calibration samples; ConfigError naming the file on bad input."""
    if max_tokens < 2 or (max_samples is not None and max_samples < 1):
        raise ConfigError("need at least one sample of at least two tokens", where="--calib-samples/--calib-tokens",
                          fix="raise --calib-samples or --calib-tokens")
    if calib is None:
        resource = resources.files("mtpkit.calibrate") / DEFAULT_SET
        text, path, source = resource.read_text(encoding="utf-8"), Path(DEFAULT_SET), f"mtpkit:{DEFAULT_SET}"
        where = source
    else:
        path = Path(calib)
        if not path.is_file():
            raise SourceNotFoundError("does not exist or is not a file", where=str(path),
                                      fix="give --calib a .txt or .jsonl file")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise ConfigError("is not UTF-8 text", where=str(path), fix="save it as UTF-8") from None
        source = path.name  # the report is published with the checkpoint: no local path in it
        where = str(path)
    records = _records(path, text)[:max_samples]
    if not records:
        raise ConfigError("holds no samples", where=where, fix="add text (blank-line separated) or JSONL records")
    text_config = config.get("text_config") or config
    vocab = int(text_config["vocab_size"])
    bos = text_config.get("bos_token_id", config.get("bos_token_id"))
    tokenizer = None
    sequences = []
    for number, record in enumerate(records, 1):
        if "input_ids" in record:
            ids = record["input_ids"]
            if not (isinstance(ids, list) and ids and all(type(i) is int and 0 <= i < vocab for i in ids)):
                raise ConfigError(f"sample {number}: input_ids must be a non-empty list of integers in [0, {vocab})",
                                  where=where, fix="write token ids of the target's vocabulary")
        else:
            if not isinstance(record["text"], str) or not record["text"]:
                raise ConfigError(f"sample {number}: text must be a non-empty string", where=where,
                                  fix="write the sample as a string")
            tokenizer = tokenizer or _tokenizer(target_folder, where)
            ids = tokenizer.encode(record["text"], add_special_tokens=False).ids
            if isinstance(bos, int) and (not ids or ids[0] != bos):
                ids = [bos] + ids
            if any(i >= vocab for i in ids):
                raise ConfigError(f"sample {number}: the tokenizer gives ids outside the model's vocab of {vocab}",
                                  where=str(target_folder / "tokenizer.json"), fix="use the target's own tokenizer")
        if len(ids) >= 2:
            sequences.append(torch.tensor(ids[:max_tokens], dtype=torch.long))
    if not sequences:
        raise ConfigError("holds no sample of two tokens or more", where=where, fix="give longer samples")
    description = {"source": source, "sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
                   "samples": len(sequences), "tokens": sum(len(s) for s in sequences),
                   "max_tokens_per_sample": max_tokens}
    return CalibrationSet(sequences, description)
