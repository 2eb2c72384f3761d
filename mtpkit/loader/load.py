"""Load a target, an assistant, or a pair into the runtime: local folders or Hub repos, BF16 or quantized.

The quantization is read from the configs (compressed-tensors or ModelOpt; never guessed from file names)
and must be one the runtime runs. Models are built on the meta device and their tensors streamed in one at
a time (memory-mapped, cast, moved to the device and assigned: no second copy), after the memory they need
has been checked against the device. A pair is validated with `check`'s rules first: errors stop it,
warnings are kept on the Pair and issued once as Python warnings.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mtpkit.convert.check import Finding, check_pair
from mtpkit.convert.checkpoint import Checkpoint, open_checkpoint
from mtpkit.convert.draft import HF_QUANT_CONFIG
from mtpkit.convert.safetensors_file import load_tensor
from mtpkit.convert.source import Source, open_source, resolve_source
from mtpkit.errors import CheckpointError, ConfigError, PairCheckError, UnsupportedModelError
from mtpkit.formats import compressed_tensors as ct
from mtpkit.formats import modelopt as mo
from mtpkit.formats.gemma4 import role_of
from mtpkit.formats.quantization import detect_quantization
from mtpkit.loader.memory import check_memory, model_bytes
from mtpkit.loader.text_parts import TextCheckpoint
from mtpkit.runtime import Gemma4Assistant, Gemma4TextModel, TextConfig, load_assistant_state_dict

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
          "float32": torch.float32, "fp32": torch.float32}
KV_CACHE_DTYPES = ("auto", "bf16", "fp8")
# What the runtime runs: every scheme mtpkit writes, in either format.
SUPPORTED = {("compressed-tensors", scheme) for scheme in ct.SCHEMES} | {("modelopt", s) for s in mo.QUANT_ALGOS}


@dataclass
class LoadedTarget:
    model: Gemma4TextModel
    config: TextConfig
    checkpoint: Checkpoint
    quantization: dict | None  # detect_quantization's reading of the configs
    kv_scales: dict | None  # the checkpoint's FP8 k/v scales (KVCache's k_scales / v_scales), if any
    device: torch.device
    dtype: torch.dtype
    nbytes: int = 0


@dataclass
class LoadedDraft:
    model: Gemma4Assistant
    checkpoint: Checkpoint
    nbytes: int = 0
    findings: list[Finding] = field(default_factory=list)


def resolve_device(device: str | torch.device) -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device} is not available (no CUDA here)", where="device",
                          fix="use device='cpu' (--device cpu), or 'auto'")
    return device


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ConfigError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}", where="dtype", fix="use bfloat16")
    return DTYPES[dtype]


def open_resolved(source: str | Path | Source, revision: str | None, local_files_only: bool) -> Checkpoint:
    """open_source, or a folder already resolved (pair_folders' target/ and draft/: in a Hub snapshot their
    files link into the repo's cache folder, which open_source would refuse for a plain local path)."""
    if isinstance(source, Source):
        return open_checkpoint(source.folder, allowed_root=source.allowed_root)
    return open_source(source, revision=revision, local_files_only=local_files_only)


def _open(source: str | Path | Source, revision: str | None, local_files_only: bool, role: str) -> Checkpoint:
    checkpoint = open_resolved(source, revision, local_files_only)
    where = str(checkpoint.folder / "config.json")
    if checkpoint.config_only:
        raise CheckpointError("holds no weights", where=checkpoint.folder,
                              fix="point at a folder with model.safetensors or an index and its shards")
    found = role_of(checkpoint.config, where)
    if found != role:
        raise ConfigError(f"is a Gemma 4 {found}, not a {role}", where=where,
                          fix="pass the target as target= (--target) and the assistant as draft= (--draft)")
    return checkpoint


def _weights_of(config: dict) -> str:
    """' (weights: int4 group)' for compressed-tensors groups no preset matches ('custom' alone names nothing)."""
    groups = (config.get("quantization_config") or {}).get("config_groups")
    groups = groups.values() if isinstance(groups, dict) else ()
    found = sorted({f"{w.get('type')}{w.get('num_bits')} {w.get('strategy')}" for g in groups
                    if isinstance(g, dict) and isinstance(w := g.get("weights"), dict)})
    return f" (weights: {', '.join(found)})" if found else ""


def load_target(source: str | Path, *, revision: str | None = None, device: str | torch.device = "auto",
                dtype: str | torch.dtype = "bfloat16", local_files_only: bool = False,
                max_memory: str | int | None = None) -> LoadedTarget:
    """A target (text decoder; a multimodal checkpoint loads text-only) ready to run on `device`."""
    device, dtype = resolve_device(device), resolve_dtype(dtype)
    checkpoint = _open(source, revision, local_files_only, "target")
    where = str(checkpoint.folder / "config.json")
    quantization = detect_quantization(checkpoint.config, checkpoint.read_json_file(HF_QUANT_CONFIG), where)
    if quantization is not None and (quantization["method"], quantization["scheme"]) not in SUPPORTED:
        raise UnsupportedModelError(f"{quantization['method']} {quantization['scheme']} quantization is not one the "
                                    f"runtime runs{_weights_of(checkpoint.config)}", where=where,
                                    fix="convert it with `mtp-convert quantize --to compressed-tensors`, or start "
                                    "from the BF16 target")
    nbytes = model_bytes(checkpoint, dtype)
    check_memory(nbytes, device, max_memory, str(checkpoint.folder))
    text = TextCheckpoint(checkpoint, dtype=dtype, device=device)
    model = text.skeleton()
    text.load_all(model)
    return LoadedTarget(model.eval(), text.config, checkpoint, quantization, text.kv_scales(), device, dtype, nbytes)


def load_draft(source: str | Path, *, revision: str | None = None, device: str | torch.device = "auto",
               dtype: str | torch.dtype = "bfloat16", local_files_only: bool = False,
               max_memory: str | int | None = None) -> LoadedDraft:
    """An assistant, built from its own config alone (never the target's quantization)."""
    device, dtype = resolve_device(device), resolve_dtype(dtype)
    checkpoint = _open(source, revision, local_files_only, "assistant")
    where = str(checkpoint.folder / "config.json")
    config = checkpoint.config
    if "quantization_config" in config or "quantization_config" in (config.get("text_config") or {}):
        raise ConfigError("carries a quantization_config (inherited from a quantized target); vLLM would then "
                          "quantize the assistant too", where=where,
                          fix=f"write a clean one with `mtp-convert draft {checkpoint.folder} OUT`")
    nbytes = model_bytes(checkpoint, dtype)
    check_memory(nbytes, device, max_memory, str(checkpoint.folder))
    try:
        model = Gemma4Assistant.skeleton(config, where)
        tensors = {name: load_tensor(info) for name, info in checkpoint.tensors.items()}
        load_assistant_state_dict(model, tensors, assign=True, dtype=dtype, device=device)
    except ValueError as e:
        raise ConfigError(str(e), where=checkpoint.folder, fix="run `mtp-convert check` on the pair") from None
    return LoadedDraft(model.eval(), checkpoint, nbytes)


def pair_folders(pair_dir_or_repo: str | Path, revision: str | None, local_files_only: bool) -> tuple[Source, Source]:
    """OUT/target and OUT/draft of a `mtp-convert pair` folder (or a Hub repo holding one)."""
    source = resolve_source(pair_dir_or_repo, revision=revision, local_files_only=local_files_only)
    folder = source.folder
    target, draft = folder / "target", folder / "draft"
    if not (target.is_dir() and draft.is_dir()):
        raise ConfigError("is not a pair folder (no target/ and draft/ in it)", where=folder,
                          fix="make one with `mtp-convert pair`, or pass target= and draft= (--target, --draft)")
    return (Source(target, source.repo_id, source.revision, source.allowed_root),
            Source(draft, source.repo_id, source.revision, source.allowed_root))


def validate_pair(target: Checkpoint, draft: Checkpoint) -> list[Finding]:
    """`check`'s rules: errors raise PairCheckError; warnings are returned and issued once."""
    findings = check_pair(target, draft)
    errors = [f for f in findings if f.severity == "error"]
    if errors:
        raise PairCheckError(f"the pair fails {len(errors)} check(s); the first, [{errors[0].id}]: {errors[0].message}",
                             findings=findings, where=f"{target.folder} + {draft.folder}",
                             fix="fix what the checks name (`mtp-convert check` lists them)")
    for finding in findings:
        warnings.warn(f"[{finding.id}] {finding.message}", stacklevel=3)
    return findings
