"""`pair`: a target and its canonical assistant in one folder, validated, with the exact launch lines.

OUT/target/ is the target copied byte for byte (or quantized, with `pair --quantize`); OUT/draft/ is the
assistant after `draft`, in BF16 as vLLM serves it beside a quantized target;
OUT/pair.json records the sources (with sha256 of every input file), the target's quantization,
the rules applied to the draft, the validation results, the recommended number of speculative
tokens and the `vllm serve` / `LLM(...)` lines for this pair. Nothing is written if `check` fails.
"""

from __future__ import annotations

import hashlib
import json
import shlex
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mtpkit.convert.atomic import atomic_output_dir
from mtpkit.convert.check import Finding, check_pair
from mtpkit.convert.checkpoint import INDEX_FILE, Checkpoint, open_checkpoint
from mtpkit.convert.draft import HF_QUANT_CONFIG, dump_json, plan_draft
from mtpkit.convert.describe import describe
from mtpkit.errors import ConfigError, PairCheckError
from mtpkit.formats import gemma4
from mtpkit.formats.quantization import detect_quantization

PAIR_FILE = "pair.json"
# Published num_speculative_tokens, keyed by the target's (text hidden_size, num_hidden_layers).
PUBLISHED_SPECULATIVE_TOKENS = {(1536, 35): ("gemma-4-E2B", 2), (2560, 42): ("gemma-4-E4B", 4),
                                (2816, 30): ("gemma-4-26B-A4B", 4), (5376, 60): ("gemma-4-31B", 8)}
DEFAULT_SPECULATIVE_TOKENS = 4


@dataclass(frozen=True)
class PairResult:
    folder: Path
    manifest: dict
    findings: list[Finding]


def recommended_tokens(target_config: dict) -> tuple[int, str]:
    text, _ = gemma4.text_config_of(target_config)
    key = (text.get("hidden_size"), text.get("num_hidden_layers"))
    if key in PUBLISHED_SPECULATIVE_TOKENS:
        name, tokens = PUBLISHED_SPECULATIVE_TOKENS[key]
        return tokens, f"the published setting for {name}"
    return DEFAULT_SPECULATIVE_TOKENS, "no published setting for this target's size; the common default"


def has_kv_scales(target: Checkpoint) -> bool:
    # vLLM reads self_attn.k_scale, self_attn.k_proj.k_scale (ModelOpt), self_attn.attn.k_scale and kv_scale.
    return any(name.endswith(("k_scale", "v_scale", "kv_scale")) for name in target.tensors)


def launch_lines(target_dir: Path, draft_dir: Path, tokens: int, fp8_kv: bool) -> dict[str, str]:
    """The commands for vLLM. No `method` key: vLLM detects the gemma4_assistant and uses its MTP path."""
    spec = {"model": str(draft_dir), "num_speculative_tokens": tokens}
    serve = f"vllm serve {shlex.quote(str(target_dir))} --speculative-config {shlex.quote(json.dumps(spec))}"
    python = f"from vllm import LLM\nllm = LLM(model={str(target_dir)!r}, speculative_config={spec!r}"
    if fp8_kv:
        serve += " --kv-cache-dtype fp8"
        python += ', kv_cache_dtype="fp8"'
    return {"vllm_serve": serve, "python": python + ")"}


def file_hashes(checkpoint: Checkpoint) -> dict[str, str]:
    files = [s.path for s in checkpoint.shards] + checkpoint.other_files()
    if (checkpoint.folder / INDEX_FILE).is_file():
        files.append(checkpoint.folder / INDEX_FILE)
    hashes = {}
    for path in sorted(files):
        with open(path, "rb") as f:
            hashes[path.relative_to(checkpoint.folder).as_posix()] = hashlib.file_digest(f, "sha256").hexdigest()
    return hashes


def _origin(checkpoint: Checkpoint) -> dict:
    origin = dict(checkpoint.origin or {"path": str(checkpoint.folder.resolve())})
    origin["sha256"] = file_hashes(checkpoint)
    return origin


def _copy_target(target: Checkpoint, folder: Path, on_bytes: Callable[[int], None] | None) -> None:
    """The target, byte for byte: its shards, index and side files (never pickles or hidden files)."""
    folder.mkdir()
    files = [s.path for s in target.shards] + target.other_files()
    if (target.folder / INDEX_FILE).is_file():
        files.append(target.folder / INDEX_FILE)
    for path in sorted(files):
        dest = folder / path.relative_to(target.folder)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, dest)
        if on_bytes:
            on_bytes(path.stat().st_size)


def pair(target: Checkpoint, draft: Checkpoint, out: str | Path, *, dialect: str = "flat", force: bool = False,
         write_target: Callable[[Path], dict] | None = None,
         on_bytes: Callable[[int], None] | None = None) -> PairResult:
    """`write_target(folder)`: writes OUT/target itself (e.g. quantized) and returns a summary for pair.json;
    without it the target is copied byte for byte."""
    out = Path(out)
    plan = plan_draft(draft, dialect=dialect)  # refuses an unusable assistant before anything is written
    # ... and an unusable target (its config read as check reads it), naming the input, not the copy.
    where = str(target.folder / "config.json")
    if describe(target).role != "target":
        raise ConfigError("is an assistant; --target takes the target", where=where,
                          fix="swap --target and --draft")
    gemma4.kv_producers(target.config, where)
    with atomic_output_dir(out, force=force, sources=(target.folder, draft.folder)) as tmp:
        produced = None
        if write_target is None:
            _copy_target(target, tmp / "target", on_bytes)
        else:
            produced = write_target(tmp / "target")
        (tmp / "draft").mkdir()
        plan.write_into(tmp / "draft", (lambda spec: on_bytes(spec.nbytes)) if on_bytes else None)
        written_target, written_draft = open_checkpoint(tmp / "target"), open_checkpoint(tmp / "draft")
        # Checked as written; reported against the inputs, since the temporary folder is never seen.
        findings = [Finding(f.id, f.severity, f.message.replace(str(tmp / "target"), str(target.folder))
                            .replace(str(tmp / "draft"), str(draft.folder)))
                    for f in check_pair(written_target, written_draft)]
        errors = [f for f in findings if f.severity == "error"]
        if errors:
            raise PairCheckError(f"the pair fails {len(errors)} check(s) (first: {errors[0].id})", findings=findings,
                                 where=out, fix="fix what the checks name; nothing was written")
        tokens, why = recommended_tokens(target.config)
        final_target, final_draft = out.resolve() / "target", out.resolve() / "draft"
        written_quantization = detect_quantization(written_target.config,
                                                   written_target.read_json_file(HF_QUANT_CONFIG))
        kv_scales = has_kv_scales(written_target)
        manifest = {
            "target": _origin(target),
            "draft": _origin(draft),
            "target_quantization": written_quantization,
            "target_quantized_by": produced,
            "target_kv_scales": kv_scales,
            "draft_rules": [r.to_json() for r in plan.rules],
            "validation": [f.to_json() for f in findings],
            "num_speculative_tokens": {"value": tokens, "why": why},
            "launch": launch_lines(final_target, final_draft, tokens, kv_scales),
        }
        (tmp / PAIR_FILE).write_text(dump_json(manifest), encoding="utf-8")
    return PairResult(out, manifest, findings)
