"""`draft`: rewrite an assistant checkpoint into canonical form, recording every rule it applied.

The config is rewritten by `draft_rules`; tensors (planned by `draft_tensors`) are copied byte for
byte unless their dtype must change or, with `dequantize`, a quantized weight is made dense again. The rules applied (and those recorded by earlier runs) are kept in the output's
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
from mtpkit.convert.draft_tensors import TensorPlan, plan_tensors
from mtpkit.convert.safetensors_file import TensorInfo
from mtpkit.convert.writer import TensorSpec, write_checkpoint_tensors
from mtpkit.errors import ConfigError
from mtpkit.formats import gemma4

REPORT_FILE = "mtpkit_draft.json"
HF_QUANT_CONFIG = "hf_quant_config.json"
DTYPE_NAMES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


@dataclass(frozen=True)
class DraftResult:
    folder: Path
    rules: list[RuleApplication]  # applied by this run
    history: list[dict]  # everything recorded in the output's report (earlier runs included)
    tensors: int
    cast: int  # tensors whose dtype changed
    dequantized: int


def is_assistant(checkpoint: Checkpoint) -> bool:
    """An assistant by model_type, or a flattened one that says gemma4_text but holds pre_projection."""
    model_type = checkpoint.config.get("model_type")
    if model_type == gemma4.ASSISTANT_MODEL_TYPE or model_type in gemma4.NONCANONICAL_ASSISTANT_TYPES:
        return True
    return model_type == "gemma4_text" and "pre_projection.weight" in checkpoint.tensors


@dataclass(frozen=True)
class DraftPlan:
    """Everything `draft` will write, decided (and validated) before any byte is written."""

    checkpoint: Checkpoint
    config: dict
    rules: list[RuleApplication]
    history: list[dict]
    tensors: TensorPlan

    def write_into(self, folder: Path, on_tensor: Callable[[TensorSpec], None] | None = None) -> None:
        """Write the canonical assistant into an existing empty folder."""
        sources = self.tensors.sources
        if self.tensors.specs:
            write_checkpoint_tensors(folder, self.tensors.specs,
                                     lambda spec: s if isinstance(s := sources[spec.name], TensorInfo) else s(),
                                     on_tensor=on_tensor)
        (folder / "config.json").write_text(dump_json(self.config), encoding="utf-8")
        copy_other_files(self.checkpoint, folder, skip={"config.json", HF_QUANT_CONFIG, REPORT_FILE})
        (folder / REPORT_FILE).write_text(dump_json({"tool": "mtp-convert draft", "rules": self.history}),
                                          encoding="utf-8")


def draft(checkpoint: Checkpoint, out: str | Path, *, dialect: str = "flat", dtype: str = "bfloat16",
          dequantize: bool = False, force: bool = False,
          on_tensor: Callable[[TensorSpec], None] | None = None) -> DraftResult:
    plan = plan_draft(checkpoint, dialect=dialect, dtype=dtype, dequantize=dequantize)
    with atomic_output_dir(out, force=force, sources=(checkpoint.folder,)) as tmp:
        plan.write_into(tmp, on_tensor)
    return DraftResult(Path(out), plan.rules, plan.history, len(plan.tensors.specs), len(plan.tensors.cast),
                       len(plan.tensors.dequantized))


def plan_draft(checkpoint: Checkpoint, *, dialect: str = "flat", dtype: str = "bfloat16",
               dequantize: bool = False) -> DraftPlan:
    where = str(checkpoint.folder / "config.json")
    if not is_assistant(checkpoint):
        gemma4.role_of(checkpoint.config, where)  # an unknown model_type gets its own message
        raise ConfigError(f"model_type {checkpoint.config.get('model_type')!r} is a target, not an assistant",
                          where=where, fix="pass the assistant (draft) checkpoint; `mtp-convert pair` takes both")
    if dtype not in DTYPE_NAMES:
        raise ConfigError(f"--dtype {dtype!r} is not one of {', '.join(DTYPE_NAMES)}", where=checkpoint.folder,
                          fix="use bfloat16 (what vLLM serves assistants in)")
    target_dtype = DTYPE_NAMES[dtype]
    # The tie is decided by the config as it will be written; a stored lm_head is then dead weight.
    tied = checkpoint.config.get("tie_word_embeddings", True) is not False
    tensors = plan_tensors(checkpoint, target_dtype, dequantize=dequantize, drop_lm_head=tied)
    config, rules = canonical_config(checkpoint.config, tensors.logical, dialect=dialect, dtype=dtype, where=where)
    if tensors.dequantized:
        rules.append(RuleApplication("dequantize", "tensors", f"{len(tensors.dequantized)} quantized weights",
                                     f"{len(tensors.dequantized)} {target_dtype}",
                                     "--dequantize: vLLM serves the assistant unquantized"))
    if tensors.cast:
        counts = Counter(checkpoint.tensors[name].dtype for name in tensors.cast)
        before = ", ".join(f"{n} {d}" for d, n in sorted(counts.items()))
        rules.append(RuleApplication("cast-dtype", "tensors", before, f"{len(tensors.cast)} {target_dtype}",
                                     f"assistant weights are served in {dtype}"))
    if "lm_head.weight" in tensors.dropped:
        rules.append(RuleApplication("tie-lm-head", "lm_head.weight", "present", ABSENT,
                                     "tie_word_embeddings is true: loaders use the embedding table as lm_head, "
                                     "so a stored copy is dead weight (and vLLM's loader does not expect it)"))
    if (checkpoint.folder / HF_QUANT_CONFIG).is_file():
        rules.append(RuleApplication("strip-quantization", HF_QUANT_CONFIG, "present", ABSENT,
                                     "a ModelOpt config copied from the target would make vLLM quantize the draft"))
    history = _history(checkpoint) + [r.to_json() for r in rules]
    return DraftPlan(checkpoint, config, rules, history, tensors)


def dump_json(value: dict) -> str:
    """The layout transformers writes (indent 2, sorted keys), so our outputs diff cleanly against theirs."""
    return json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


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
