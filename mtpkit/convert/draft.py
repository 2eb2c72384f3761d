"""`draft`: rewrite an assistant checkpoint into canonical form, recording every rule it applied.

The config is rewritten by `draft_rules`; tensors are copied byte for byte unless their dtype must
change. The rules applied (and those recorded by earlier runs) are kept in the output's
`mtpkit_draft.json`, so `draft(draft(x))` is byte-identical to `draft(x)`.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mtpkit.convert.atomic import atomic_output_dir
from mtpkit.convert.checkpoint import Checkpoint
from mtpkit.convert.draft_rules import ABSENT, RuleApplication, canonical_config
from mtpkit.convert.reshard import copy_other_files
from mtpkit.convert.safetensors_file import TensorInfo, load_tensor
from mtpkit.convert.writer import TensorSpec, write_checkpoint_tensors
from mtpkit.errors import CheckpointError, ConfigError
from mtpkit.formats import gemma4
from mtpkit.formats.dtypes import torch_dtype

REPORT_FILE = "mtpkit_draft.json"
HF_QUANT_CONFIG = "hf_quant_config.json"
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
DTYPE_NAMES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
# Tensors that are integer by design (a permutation of token ids), never cast.
_INTEGER_TENSORS = ("masked_embedding.token_ordering",)


@dataclass(frozen=True)
class DraftResult:
    folder: Path
    rules: list[RuleApplication]  # applied by this run
    history: list[dict]  # everything recorded in the output's report (earlier runs included)
    tensors: int
    cast: int  # tensors whose dtype changed


def is_assistant(checkpoint: Checkpoint) -> bool:
    """An assistant by model_type, or a flattened one that says gemma4_text but holds pre_projection."""
    model_type = checkpoint.config.get("model_type")
    if model_type == gemma4.ASSISTANT_MODEL_TYPE or model_type in gemma4.NONCANONICAL_ASSISTANT_TYPES:
        return True
    return model_type == "gemma4_text" and "pre_projection.weight" in checkpoint.tensors


def quantized_tensors(tensors: dict[str, TensorInfo]) -> list[TensorInfo]:
    """Tensors that are not plain floats (FP8/FP4 weights, their scales): a quantized draft."""
    scales = ("weight_scale", "weight_scale_2", "weight_global_scale", "input_scale", "input_global_scale")
    return [t for name, t in tensors.items()
            if (t.dtype not in FLOAT_DTYPES and not name.endswith(_INTEGER_TENSORS)) or name.rsplit(".", 1)[-1] in scales]


@dataclass(frozen=True)
class DraftPlan:
    """Everything `draft` will write, decided (and validated) before any byte is written."""

    checkpoint: Checkpoint
    config: dict
    rules: list[RuleApplication]
    history: list[dict]
    specs: list[TensorSpec]
    cast: set[str]

    def write_into(self, folder: Path, on_tensor: Callable[[TensorSpec], None] | None = None) -> None:
        """Write the canonical assistant into an existing empty folder."""
        if self.specs:
            write_checkpoint_tensors(folder, self.specs, lambda spec: _produce(self.checkpoint, spec, self.cast),
                                     on_tensor=on_tensor)
        (folder / "config.json").write_text(dump_json(self.config), encoding="utf-8")
        copy_other_files(self.checkpoint, folder, skip={"config.json", HF_QUANT_CONFIG, REPORT_FILE})
        (folder / REPORT_FILE).write_text(dump_json({"tool": "mtp-convert draft", "rules": self.history}),
                                          encoding="utf-8")


def draft(checkpoint: Checkpoint, out: str | Path, *, dialect: str = "flat", dtype: str = "bfloat16",
          force: bool = False, on_tensor: Callable[[TensorSpec], None] | None = None) -> DraftResult:
    plan = plan_draft(checkpoint, dialect=dialect, dtype=dtype)
    with atomic_output_dir(out, force=force, sources=(checkpoint.folder,)) as tmp:
        plan.write_into(tmp, on_tensor)
    return DraftResult(Path(out), plan.rules, plan.history, len(plan.specs), len(plan.cast))


def plan_draft(checkpoint: Checkpoint, *, dialect: str = "flat", dtype: str = "bfloat16") -> DraftPlan:
    where = str(checkpoint.folder / "config.json")
    if not is_assistant(checkpoint):
        gemma4.role_of(checkpoint.config, where)  # an unknown model_type gets its own message
        raise ConfigError(f"model_type {checkpoint.config.get('model_type')!r} is a target, not an assistant",
                          where=where, fix="pass the assistant (draft) checkpoint; `mtp-convert pair` takes both")
    if dtype not in DTYPE_NAMES:
        raise ConfigError(f"--dtype {dtype!r} is not one of {', '.join(DTYPE_NAMES)}", where=checkpoint.folder,
                          fix="use bfloat16 (what vLLM serves assistants in)")
    quantized = quantized_tensors(checkpoint.tensors)
    if quantized:
        first = quantized[0]
        raise CheckpointError(
            f"the assistant's tensors are quantized ({first.name} is {first.dtype}; {len(quantized)} such tensors)",
            where=first.file, fix="vLLM serves the assistant unquantized: start from the BF16 assistant checkpoint")
    config, rules = canonical_config(checkpoint.config, checkpoint.tensors, dialect=dialect, dtype=dtype, where=where)
    target_dtype = DTYPE_NAMES[dtype]
    dropped = set()
    if config.get("tie_word_embeddings") is True and "lm_head.weight" in checkpoint.tensors:
        dropped.add("lm_head.weight")
        rules.append(RuleApplication("tie-lm-head", "lm_head.weight", "present", ABSENT,
                                     "tie_word_embeddings is true: loaders use the embedding table as lm_head, "
                                     "so a stored copy is dead weight (and vLLM's loader does not expect it)"))
    specs, cast = _tensor_plan(checkpoint, target_dtype, dropped)
    if cast:
        counts = Counter(checkpoint.tensors[name].dtype for name in cast)
        before = ", ".join(f"{n} {d}" for d, n in sorted(counts.items()))
        rules.append(RuleApplication("cast-dtype", "tensors", before, f"{len(cast)} {target_dtype}",
                                     f"assistant weights are served in {dtype}"))
    if (checkpoint.folder / HF_QUANT_CONFIG).is_file():
        rules.append(RuleApplication("strip-quantization", HF_QUANT_CONFIG, "present", ABSENT,
                                     "a ModelOpt config copied from the target would make vLLM quantize the draft"))
    history = _history(checkpoint) + [r.to_json() for r in rules]
    return DraftPlan(checkpoint, config, rules, history, specs, cast)


def dump_json(value: dict) -> str:
    """The layout transformers writes (indent 2, sorted keys), so our outputs diff cleanly against theirs."""
    return json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def _tensor_plan(checkpoint: Checkpoint, target_dtype: str, dropped: set[str]) -> tuple[list[TensorSpec], set[str]]:
    specs, cast = [], set()
    for name, info in checkpoint.tensors.items():
        if name in dropped:
            continue
        if info.dtype in FLOAT_DTYPES and info.dtype != target_dtype:
            cast.add(name)
            specs.append(TensorSpec(name, target_dtype, info.shape))
        else:
            specs.append(TensorSpec.of(info))
    return specs, cast


def _produce(checkpoint: Checkpoint, spec: TensorSpec, cast: set[str]):
    info = checkpoint.tensors[spec.name]
    if spec.name not in cast:
        return info  # unchanged: copied byte for byte
    return load_tensor(info).to(torch_dtype(spec.dtype))


def _history(checkpoint: Checkpoint) -> list[dict]:
    """Rules recorded by an earlier `draft` of this checkpoint (kept, so a re-run changes nothing)."""
    report = checkpoint.read_json_file(REPORT_FILE)
    if report is None:
        return []
    rules = report.get("rules")
    if not isinstance(rules, list):
        raise ConfigError("has no 'rules' list", where=checkpoint.folder / REPORT_FILE,
                          fix=f"delete {REPORT_FILE}; it is only a record")
    return rules
