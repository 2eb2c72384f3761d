"""Quantize with calibration and evaluation: calibrate -> convert.quantize -> evaluate the written output.

Calibration runs only when something static needs it (fp8 / nvfp4 input scales, FP8 KV-cache scales).
The evaluation (on by default) runs on the finished output inside quantize's atomic write, so the report
saved with the checkpoint holds it. With a weight-only or dynamic scheme, no `--calib`, and no tokenizer
in the target folder, there is no text to evaluate on: the report says so rather than failing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mtpkit.calibrate.data import DEFAULT_MAX_TOKENS, CalibrationSet, load_calibration_set
from mtpkit.calibrate.evaluate import evaluate_quantization
from mtpkit.calibrate.observe import observe
from mtpkit.convert.checkpoint import Checkpoint, open_checkpoint
from mtpkit.convert.quantize import QuantizeResult, plan_quantization, write_quantized
from mtpkit.convert.quantize_static import StaticScales
from mtpkit.errors import ConfigError
from mtpkit.loader.text_parts import TextCheckpoint


@dataclass(frozen=True)
class Progress:
    """Callbacks the CLI turns into progress bars; each may be None."""

    start: Callable[[str, int], None] | None = None  # (what, total steps) at the start of a phase
    advance: Callable[[int], None] | None = None  # steps done


def _phase(progress: Progress, what: str, total: int) -> Callable[[int], None] | None:
    if progress.start:
        progress.start(what, total)
    return progress.advance


def quantize_calibrated(checkpoint: Checkpoint, out: str | Path, *, scheme: str, fmt: str = "compressed-tensors",
                        ignore: list[str] = (), targets: list[str] = ("Linear",), kv_cache: bool = False, calib: str | Path | None = None,
                        calib_samples: int | None = None, calib_tokens: int = DEFAULT_MAX_TOKENS,
                        evaluate: bool = True, force: bool = False, progress: Progress = Progress()) -> QuantizeResult:
    """Check everything first (refusals, every weight, the calibration inputs), then calibrate, write, evaluate."""
    # Pass 1 (validate, amax) and pass 2 (write) each read the quantized weights once.
    advance = _phase(progress, "checking", checkpoint.total_bytes)
    plan = plan_quantization(checkpoint, out, scheme=scheme, fmt=fmt, ignore=ignore, targets=list(targets),
                             kv_cache=kv_cache, force=force, on_bytes=advance)
    calibration: CalibrationSet | None = None
    skipped = None
    if plan.needs_calibration or evaluate:
        try:
            calibration = load_calibration_set(calib, checkpoint.folder, checkpoint.config,
                                               max_samples=calib_samples, max_tokens=calib_tokens)
        except ConfigError as e:
            no_tokenizer = not (checkpoint.folder / "tokenizer.json").is_file()
            if plan.needs_calibration or calib is not None or not no_tokenizer:
                raise
            skipped = f"no text to evaluate on: {e.what}"
    scales = None
    text = TextCheckpoint(checkpoint) if calibration is not None else None
    if plan.needs_calibration:
        advance = _phase(progress, "calibrating", text.config.num_hidden_layers)
        observed = observe(text, calibration, on_layer=(lambda _i: advance(1)) if advance else None)
        scales = StaticScales(observed.linear_input_amax, observed.kv_amax if kv_cache else {}, observed.inputs)

    def run_evaluation(folder: Path) -> dict:
        if calibration is None:
            return {"skipped": skipped}
        advance = _phase(progress, "evaluating", text.config.num_hidden_layers)
        quantized = TextCheckpoint(open_checkpoint(folder), dtype=text.dtype)
        report = evaluate_quantization(text, quantized, scheme, calibration,
                                       on_layer=(lambda _i: advance(1)) if advance else None)
        return {"inputs": calibration.description, **report}

    advance = _phase(progress, "writing", checkpoint.total_bytes)
    return write_quantized(plan, scales=scales, evaluate=run_evaluation if evaluate else None, on_bytes=advance)


def pair_summary(report: dict) -> dict:
    """What pair.json records of a quantization report: all but the per-module details, which stay in the
    target's own mtpkit_quantize.json."""
    return {key: value for key, value in report.items() if key not in ("relative_weight_error", "kept_unquantized")}
