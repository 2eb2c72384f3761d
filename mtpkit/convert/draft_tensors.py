"""Which tensors a canonical assistant holds, and where each comes from: a byte copy, a cast, or a dequantization.

Decided from the headers alone, before anything is written, so a draft that cannot be made right is
refused up front.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from mtpkit.convert.checkpoint import Checkpoint
from mtpkit.convert.safetensors_file import TensorInfo, load_tensor
from mtpkit.convert.writer import TensorSpec
from mtpkit.errors import CheckpointError
from mtpkit.formats.dequantize import ModulePlan, dequantize_weight, plan_modules
from mtpkit.formats.dtypes import itemsize, torch_dtype

FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
# Integer by design (a permutation of token ids), never cast.
_INTEGER_TENSORS = ("masked_embedding.token_ordering",)
_SCALES = ("weight_scale", "weight_scale_2", "weight_global_scale", "input_scale", "input_global_scale")

Source = TensorInfo | Callable[[], "object"]  # a raw copy, or a function producing the tensor


@dataclass
class TensorPlan:
    specs: list[TensorSpec] = field(default_factory=list)
    sources: dict[str, Source] = field(default_factory=dict)
    logical: dict[str, TensorInfo] = field(default_factory=dict)  # the written tensors' names, dtypes, shapes
    cast: list[str] = field(default_factory=list)
    dequantized: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)

    def add(self, info: TensorInfo, dtype: str, shape: tuple[int, ...], source: Source) -> None:
        self.specs.append(TensorSpec(info.name, dtype, shape))
        self.sources[info.name] = source
        self.logical[info.name] = replace(info, dtype=dtype, shape=shape, nbytes=math.prod(shape) * itemsize(dtype))


def quantized_tensors(tensors: dict[str, TensorInfo]) -> list[TensorInfo]:
    """Tensors that are not plain floats (FP8/FP4 weights, their scales): a quantized draft."""
    return [t for name, t in tensors.items()
            if (t.dtype not in FLOAT_DTYPES and not name.endswith(_INTEGER_TENSORS)) or name.rsplit(".", 1)[-1] in _SCALES]


def _dense_shape(module: ModulePlan, tensors: dict[str, TensorInfo]) -> tuple[int, ...]:
    """The dequantized weight's shape: packed FP4 holds two columns per byte."""
    if "weight_packed" in module.sources:
        packed = tensors[module.sources["weight_packed"]]
        return (packed.shape[0], packed.shape[1] * 2)
    weight = tensors.get(module.sources.get("weight", ""))
    if weight is None or len(weight.shape) != 2:
        raise CheckpointError(f"module {module.prefix!r} has quantization scales but no 2-D weight to dequantize",
                              where=next(iter(tensors.values())).file, fix="restore the original assistant")
    return (weight.shape[0], weight.shape[1] * 2) if weight.dtype == "U8" else weight.shape


def _dequantizer(module: ModulePlan, tensors: dict[str, TensorInfo], dtype: str) -> Callable[[], object]:
    def produce():
        loaded = {suffix: load_tensor(tensors[name]) for suffix, name in module.sources.items()}
        try:
            return dequantize_weight(loaded, torch_dtype(dtype), name=module.prefix)
        except ValueError as e:
            raise CheckpointError(str(e), where=tensors[next(iter(module.sources.values()))].file,
                                  fix="restore the original assistant, or start from its BF16 checkpoint") from e
    return produce


def plan_tensors(checkpoint: Checkpoint, dtype: str, *, dequantize: bool, drop_lm_head: bool) -> TensorPlan:
    tensors = checkpoint.tensors
    quantized = quantized_tensors(tensors)
    if quantized and not dequantize:
        first = quantized[0]
        raise CheckpointError(
            f"the assistant's tensors are quantized ({first.name} is {first.dtype}; {len(quantized)} such tensors)",
            where=first.file, fix="vLLM serves the assistant unquantized: pass --dequantize to write "
                                  f"{dtype} weights, or start from the BF16 assistant checkpoint")
    plan = TensorPlan()
    modules = {m.weight_name: m for m in plan_modules(tensors).values()} if quantized else {}
    plan.dropped = sorted({name for m in modules.values() for name in m.drop}
                          | ({"lm_head.weight"} & set(tensors) if drop_lm_head else set()))
    for weight_name, module in modules.items():
        if module.quantized:
            source_info = tensors[module.sources.get("weight_packed") or module.sources["weight"]]
            plan.add(replace(source_info, name=weight_name), dtype, _dense_shape(module, tensors),
                     _dequantizer(module, tensors, dtype))
            plan.dequantized.append(weight_name)
    for name, info in tensors.items():
        if name in plan.dropped or name in plan.sources:
            continue
        # Token ids are never cast: BF16 holds integers exactly only up to 256.
        if info.dtype in FLOAT_DTYPES and info.dtype != dtype and not name.endswith(_INTEGER_TENSORS):
            plan.add(info, dtype, info.shape, lambda info=info: load_tensor(info).to(torch_dtype(dtype)))
            plan.cast.append(name)
        else:
            plan.add(info, info.dtype, info.shape, info)  # unchanged: copied byte for byte
    return plan
