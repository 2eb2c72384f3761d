"""Activation fake quantization against compressed-tensors' own forward_quantize (what transformers runs)."""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs, QuantizationStatus
from compressed_tensors.quantization.lifecycle.forward import forward_quantize
from torch import nn

from mtpkit.formats.activation_quant import fake_quantize_input
from mtpkit.formats.compressed_tensors import SCHEMES
from mtpkit.formats.nvfp4 import nvfp4_global_scale


def _theirs(x: torch.Tensor, scheme: str, **scales: torch.Tensor) -> torch.Tensor:
    module = nn.Module()
    module.quantization_status = QuantizationStatus.FROZEN
    for name, value in scales.items():
        setattr(module, name, nn.Parameter(value, requires_grad=False))
    args = QuantizationArgs.model_validate(SCHEMES[scheme][2])
    return forward_quantize(module, x, "input", args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scheme", ["fp8-dynamic", "fp8-block", "fp8", "nvfp4"])
def test_equals_compressed_tensors_forward_quantize(scheme, dtype):
    torch.manual_seed(0)
    x = (torch.randn(2, 5, 256) * torch.logspace(-2, 1, 256)).to(dtype)
    x[0, 1, 3] = 0.0
    amax = x.abs().amax().float().reshape(1)
    scales = {}
    if scheme == "fp8":
        scales["input_scale"] = (amax / 448).to(dtype)
    if scheme == "nvfp4":
        scales["input_global_scale"] = nvfp4_global_scale(amax)
    ours = fake_quantize_input(x, scheme, **scales)
    theirs = _theirs(x, scheme, **scales)
    assert ours.dtype == x.dtype
    assert torch.equal(ours, theirs)  # the same bits, in bf16 too (scales and quotients rounded as there)
    assert not torch.equal(ours, x)  # it did quantize


def test_weight_only_scheme_leaves_activations_alone():
    x = torch.randn(3, 32)
    assert fake_quantize_input(x, "nvfp4a16") is x


def test_static_schemes_need_their_scale():
    with pytest.raises(ValueError, match="input_scale"):
        fake_quantize_input(torch.randn(2, 16), "fp8")
    with pytest.raises(ValueError, match="input_global_scale"):
        fake_quantize_input(torch.randn(2, 16), "nvfp4")
