"""FP8 / NVFP4 quantization checked byte for byte against compressed-tensors' own scale, quantize and compress code.

The oracle is compressed-tensors' CPU path: `calculate_qparams` / `generate_gparam` fed the min/max its preset's
observer would see, then `FloatQuantizationCompressor.compress` / `NVFP4PackedCompressor.compress`, and their
`decompress` for the round trip. ModelOpt's weight_scale_2 is checked against NVIDIA's published formula.
"""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor
from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
from compressed_tensors.quantization import preset_name_to_scheme
from compressed_tensors.quantization.lifecycle.initialize import initialize_module_for_quantization
from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam, maybe_pad_tensor_for_block_quant

from mtpkit.formats.fp8 import FP8_DTYPE, check_finite, dequantize_fp8, fp8_weight_scale, quantize_fp8
from mtpkit.formats.nvfp4 import (
    dequantize_nvfp4,
    modelopt_weight_scale_2,
    nvfp4_global_scale,
    nvfp4_group_scales,
    quantize_nvfp4,
    unpack_fp4_codes,
)

SHAPES = [(64, 96), (200, 304)]  # 304 = 19 * 16; 200 x 304 has partial 128x128 edge blocks
DTYPES = [torch.bfloat16, torch.float32]
FP8_PRESETS = [("FP8", "tensor"), ("FP8_DYNAMIC", "channel"), ("FP8_BLOCK", "block")]
U8 = torch.uint8


def _weight(shape, dtype, seed=0, std=0.05):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=generator) * std).to(dtype)


def _ct_fp8_scale(weight, preset):
    """compressed-tensors' scale from the min/max its observer takes (in `weight`'s dtype) for the preset."""
    args = preset_name_to_scheme(preset, ["Linear"]).weights
    if args.strategy == "tensor":
        lo, hi = torch.aminmax(weight)
    elif args.strategy == "channel":
        lo, hi = weight.amin(1, keepdim=True), weight.amax(1, keepdim=True)
    else:
        bh, bw = args.block_structure
        tiles = maybe_pad_tensor_for_block_quant(weight, (bh, bw)).unflatten(0, (-1, bh)).unflatten(-1, (-1, bw))
        lo, hi = tiles.amin((1, 3)), tiles.amax((1, 3))
    return calculate_qparams(lo, hi, args)[0]


def _ct_fp8_compress(weight, scale, preset):
    scheme = preset_name_to_scheme(preset, ["Linear"])
    compressed = FloatQuantizationCompressor.compress({"weight": weight, "weight_scale": scale}, scheme)
    return compressed, FloatQuantizationCompressor.decompress(compressed, scheme)["weight"]


def _ct_stored_scale(shape, dtype, preset):
    """The weight_scale parameter compressed-tensors registers on a Linear for the preset (shape, dtype)."""
    linear = torch.nn.Linear(shape[1], shape[0], bias=False, dtype=dtype)
    initialize_module_for_quantization(linear, preset_name_to_scheme(preset, ["Linear"]))
    return linear.weight_scale


def _check_fp8_against_ct(weight, preset, strategy, scale):
    """Our FP8 bytes == compressed-tensors' compress with the same scale, and both round trips agree."""
    compressed, reference = _ct_fp8_compress(weight, scale, preset)
    ours = quantize_fp8(weight, scale)
    assert ours.dtype == FP8_DTYPE and ours.shape == weight.shape
    assert torch.equal(ours.view(U8), compressed["weight"].view(U8))
    assert torch.equal(dequantize_fp8(ours, scale, reference.dtype), reference)
    return ours


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("preset", "strategy"), FP8_PRESETS)
def test_fp8_scale_matches_compressed_tensors(preset, strategy, shape, dtype):
    weight = _weight(shape, dtype)
    ours = fp8_weight_scale(weight, strategy)
    assert ours.dtype == torch.float32
    assert ours.shape == _ct_stored_scale(shape, dtype, preset).shape
    # Equal to calculate_qparams on float32 min/max, and (cast) to what it gives on the weight's own dtype,
    # which is what llm-compressor stores for a bf16 model.
    assert torch.equal(ours, _ct_fp8_scale(weight.float(), preset))
    native = _ct_fp8_scale(weight, preset)
    assert native.dtype == dtype and torch.equal(ours.to(dtype), native)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("preset", "strategy"), FP8_PRESETS)
@pytest.mark.parametrize("scale_dtype", ["float32", "weight"])
def test_fp8_bytes_and_round_trip_match_compressed_tensors(preset, strategy, shape, dtype, scale_dtype):
    weight = _weight(shape, dtype, seed=1)
    scale = fp8_weight_scale(weight, strategy)
    # With a bf16 scale the division runs in bf16, as llm-compressor's own compress does.
    _check_fp8_against_ct(weight, preset, strategy, scale if scale_dtype == "float32" else scale.to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("preset", "strategy"), FP8_PRESETS)
def test_fp8_zero_rows_blocks_and_tensor(preset, strategy, dtype):
    weight = _weight((200, 304), dtype, seed=2)
    weight[:3] = 0  # zero rows
    weight[128:, 256:] = 0  # the whole partial corner block
    for w in (weight, torch.zeros_like(weight)):
        scale = fp8_weight_scale(w, strategy)
        assert torch.equal(scale, _ct_fp8_scale(w.float(), preset))
        assert bool((scale > 0).all())
        ours = _check_fp8_against_ct(w, preset, strategy, scale)
        assert not ours[:3].view(U8).any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("preset", "strategy"), FP8_PRESETS)
def test_fp8_saturation_and_cast_ties(preset, strategy, dtype):
    weight = _weight((200, 304), dtype, seed=3)
    scale = fp8_weight_scale(weight, strategy)
    big = weight.clone()
    big[5, :7] = torch.tensor([1e30, -1e30, 3e38, -3e38, 1e4, -1e4, 2.0]).to(dtype)  # beyond 448 * scale
    ours = _check_fp8_against_ct(big, preset, strategy, scale)
    assert ours[5, :6].float().tolist() == [448.0, -448.0, 448.0, -448.0, 448.0, -448.0]
    # Values that land exactly between two E4M3 numbers (1.0/1.125, 1.125/1.25, 256/288) round to even.
    ties = torch.zeros(16, 128, dtype=dtype)
    ties[:, :4] = torch.tensor([1.0625, 1.1875, 272.0, 448.0])  # amax 448 -> scale 1, quotients exact
    ours = _check_fp8_against_ct(ties, preset, strategy, fp8_weight_scale(ties, strategy))
    assert ours[0, :4].float().tolist() == [1.0, 1.25, 256.0, 448.0]


def _ct_nvfp4(weight, global_scale):
    """compressed-tensors NVFP4: group scales from the weight-dtype group min/max, then its compress."""
    scheme = preset_name_to_scheme("NVFP4", ["Linear"])
    groups = weight.unflatten(-1, (-1, 16))
    scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights, global_scale=global_scale)
    state = {"weight": weight, "weight_scale": scale, "weight_global_scale": global_scale}
    compressed = NVFP4PackedCompressor.compress(state, scheme)
    return scale, compressed, NVFP4PackedCompressor.decompress(compressed, scheme)["weight"]


def _check_nvfp4_against_ct(weight, global_scale):
    scale, compressed, reference = _ct_nvfp4(weight, global_scale)
    ours_scales = nvfp4_group_scales(weight, global_scale)
    assert ours_scales.dtype == FP8_DTYPE and torch.equal(ours_scales.float(), scale)
    assert torch.equal(ours_scales.view(U8), compressed["weight_scale"].view(U8))
    packed = quantize_nvfp4(weight, ours_scales, global_scale)
    assert packed.dtype == U8 and torch.equal(packed, compressed["weight_packed"])
    ours = dequantize_nvfp4(packed, ours_scales, global_scale, convention="compressed-tensors",
                            dtype=reference.dtype)
    assert torch.equal(ours, reference)
    return ours_scales, packed


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_nvfp4_matches_compressed_tensors(shape, dtype):
    weight = _weight(shape, dtype, seed=4)
    amax = weight.float().abs().amax()
    global_scale = nvfp4_global_scale(amax)
    assert global_scale.dtype == torch.float32 and global_scale.shape == (1,)
    assert torch.equal(global_scale, generate_gparam(*torch.aminmax(weight.float())))
    _check_nvfp4_against_ct(weight, global_scale)
    # A fused q/k/v-style global scale from a larger shared amax: this weight's group scales sit below 448.
    fused = nvfp4_global_scale(torch.maximum(amax, torch.tensor(0.7)))
    assert torch.equal(fused, generate_gparam(torch.tensor(-0.7), torch.tensor(0.7)))
    _check_nvfp4_against_ct(weight, fused)


TIES = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, -0.0]
TIE_CODES = [7, 0, 2, 2, 4, 4, 6, 6, 8, 10, 10, 12, 12, 14, 14, 0]  # nearest, ties to the even code


@pytest.mark.parametrize("dtype", DTYPES)
def test_nvfp4_e2m1_ties_round_to_even_like_compressed_tensors(dtype):
    # amax 6 -> global 448, so a group with amax 6 gets scale 448 and W / (448 / 448) lands on the midpoints
    # exactly; the same values / 8 get scale 56 (exact in FP8) and * 0.5 scale 224, so they land there too.
    row = torch.tensor(TIES)
    weight = torch.stack([torch.cat([row, row / 8]), torch.cat([row * 0.5, -row / 8])]).to(dtype)
    global_scale = nvfp4_global_scale(torch.tensor(6.0))
    assert global_scale.item() == 448.0
    scales, packed = _check_nvfp4_against_ct(weight, global_scale)
    assert scales.float().tolist()[0] == [448.0, 56.0]
    assert unpack_fp4_codes(packed, 2, 32)[0].tolist() == TIE_CODES * 2


@pytest.mark.parametrize("dtype", DTYPES)
def test_nvfp4_quotients_at_midpoints_follow_compressed_tensors_division(dtype):
    # Weights at midpoint * (group_scale / global) and one float32 ulp either side, for scales whose reciprocal
    # is inexact: W / s lands on or next to a midpoint, where division and multiplication by 1/s round apart.
    generator = torch.Generator().manual_seed(7)
    finite_fp8 = torch.arange(0x20, 0x7F, dtype=U8).view(FP8_DTYPE)
    group_scales = finite_fp8[torch.randint(len(finite_fp8), (48, 4), generator=generator)]
    global_scale = nvfp4_global_scale(torch.tensor(0.8))
    midpoints = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.75])
    effective = (group_scales.float() / global_scale).repeat_interleave(16, dim=1)
    weight = torch.cat([midpoints, -midpoints]).repeat(48, 4) * effective
    weight[1::3] = torch.nextafter(weight[1::3], torch.tensor(float("inf")))
    weight[2::3] = torch.nextafter(weight[2::3], torch.tensor(0.0))
    weight = weight.to(dtype)
    scheme = preset_name_to_scheme("NVFP4", ["Linear"])
    state = {"weight": weight, "weight_scale": group_scales.float(), "weight_global_scale": global_scale}
    expected = NVFP4PackedCompressor.compress(state, scheme)["weight_packed"]
    assert torch.equal(quantize_nvfp4(weight, group_scales, global_scale), expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_nvfp4_zero_tiny_and_saturating_groups(dtype):
    weight = _weight((64, 96), dtype, seed=5)
    weight[:2] = 0  # all-zero rows -> scale 0.125, codes 0
    weight[2, :16] = 1e-8  # a group whose scale underflows FP8 next to a large global -> also 0.125
    weight[3, :16] = 10.0  # far above the amax the global scale is given: the scale clamps at 448, codes saturate
    global_scale = nvfp4_global_scale(torch.tensor(0.2))
    scales, packed = _check_nvfp4_against_ct(weight, global_scale)
    assert scales[:3, 0].float().tolist() == [0.125, 0.125, 0.125] and scales[3, 0].float().item() == 448.0
    assert not packed[:2].any() and torch.equal(packed[3, :8], torch.full((8,), 0x77, dtype=U8))
    zeros = torch.zeros(8, 32, dtype=dtype)
    global_zero = nvfp4_global_scale(zeros.float().abs().amax())
    assert torch.equal(global_zero, generate_gparam(*torch.aminmax(zeros.float()))) and global_zero.item() == 1.0
    scales, packed = _check_nvfp4_against_ct(zeros, global_zero)
    assert (scales.float() == 0.125).all() and not packed.any()


def test_modelopt_weight_scale_2_is_the_reciprocal_of_the_global_scale():
    amaxes = torch.cat([torch.rand(500) * 10, torch.rand(500) * 1e-3, torch.tensor([1e-30, 2688.0, 448.0, 1.0])])
    for amax in amaxes:
        scale_2 = modelopt_weight_scale_2(amax)
        assert scale_2.shape == () and scale_2.dtype == torch.float32
        # NVIDIA's formula: NVFP4QTensor.get_weights_scaling_factor_2 in
        # NVIDIA/Model-Optimizer modelopt/torch/quantization/qtensor/nvfp4_tensor.py.
        assert torch.equal(scale_2, amax.float() / (6.0 * 448.0))
        # Three float32 roundings (each quotient, then the product): within 2^-22 of 1.
        assert abs((scale_2 * nvfp4_global_scale(amax)).item() - 1.0) <= 2.0**-22, amax
    # Where compressed-tensors falls back to a global scale of 1, so does weight_scale_2.
    for amax in (torch.tensor(0.0), torch.tensor(1e-40)):
        assert nvfp4_global_scale(amax).item() == 1.0 and modelopt_weight_scale_2(amax).item() == 1.0


NAME = "model.layers.0.mlp.up_proj.weight"


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", DTYPES)
def test_non_finite_weights_are_refused_by_name(bad, dtype):
    weight = _weight((64, 96), dtype, seed=6)
    weight[7, 11] = bad
    calls = [
        lambda: check_finite(weight, NAME),
        lambda: fp8_weight_scale(weight, "channel", name=NAME),
        lambda: quantize_fp8(weight, torch.ones(1), name=NAME),
        lambda: nvfp4_group_scales(weight, torch.ones(1), name=NAME),
        lambda: quantize_nvfp4(weight, torch.ones(64, 6, dtype=FP8_DTYPE), torch.ones(1), name=NAME),
    ]
    for call in calls:
        with pytest.raises(ValueError, match="NaN" if bad != bad else "1 Inf") as info:
            call()
        assert NAME in str(info.value)
    check_finite(torch.zeros(3, 3), NAME)  # finite: no error


@pytest.mark.parametrize(("call", "message"), [
    (lambda: nvfp4_group_scales(torch.zeros(8, 40), torch.ones(1), name=NAME), "divisible by 16"),
    (lambda: quantize_nvfp4(torch.zeros(8, 24), torch.ones(8, 1, dtype=FP8_DTYPE), torch.ones(1), name=NAME),
     "divisible by 16"),
    (lambda: nvfp4_group_scales(torch.zeros(32), torch.ones(1), name=NAME), "must be 2-D"),
    (lambda: nvfp4_group_scales(torch.zeros(2, 4, 32), torch.ones(1), name=NAME), "must be 2-D"),
    (lambda: quantize_nvfp4(torch.zeros(4, 32), torch.ones(4, 3, dtype=FP8_DTYPE), torch.ones(1), name=NAME),
     r"float8_e4m3fn \[4, 2\]"),
    (lambda: quantize_nvfp4(torch.zeros(4, 32), torch.ones(4, 2), torch.ones(1), name=NAME), "float8_e4m3fn"),
    (lambda: quantize_nvfp4(torch.zeros(4, 32), torch.zeros(4, 2, dtype=FP8_DTYPE), torch.ones(1), name=NAME),
     "finite and > 0"),
    (lambda: nvfp4_group_scales(torch.zeros(4, 32), torch.zeros(1), name=NAME), "finite and > 0"),
    (lambda: nvfp4_group_scales(torch.zeros(4, 32), torch.ones(2), name=NAME), "one float value"),
    (lambda: nvfp4_group_scales(torch.zeros(4, 32, dtype=torch.int32), torch.ones(1), name=NAME), "float tensor"),
    (lambda: fp8_weight_scale(torch.zeros(4, 8, 2), "tensor", name=NAME), "must be 2-D"),
    (lambda: fp8_weight_scale(torch.zeros(4, 8), "row", name=NAME), "'tensor', 'channel' or 'block'"),
    (lambda: quantize_fp8(torch.zeros(200, 300), torch.ones(2, 2), name=NAME), r"fits no FP8 layout .*\[2, 3\]"),
    (lambda: quantize_fp8(torch.zeros(4, 8), torch.zeros(4, 1), name=NAME), "finite and > 0"),
    (lambda: quantize_fp8(torch.zeros(4, 8), torch.ones(1, dtype=torch.int32), name=NAME), "float16/bfloat16"),
    (lambda: quantize_fp8(torch.zeros(4, 8, dtype=FP8_DTYPE), torch.ones(1), name=NAME), "float tensor"),
])
def test_shape_and_argument_errors_name_the_tensor(call, message):
    with pytest.raises(ValueError, match=message) as info:
        call()
    assert NAME in str(info.value)


@pytest.mark.parametrize("amax", [torch.tensor(float("nan")), torch.tensor(-1.0), torch.ones(2), torch.tensor(3)])
def test_bad_amax_is_refused(amax):
    for call in (nvfp4_global_scale, modelopt_weight_scale_2):
        with pytest.raises(ValueError, match="amax"):
            call(amax)
