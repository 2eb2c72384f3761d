"""Dequantization checked against compressed-tensors' own quantize/compress/decompress code (the oracle).

ModelOpt's NVFP4 layout is derived from compressed-tensors' tensors by the published relation weight_scale_2 =
1 / weight_global_scale (ModelOpt: amax / (6 * 448); compressed-tensors: 448 * 6 / amax)."""

from __future__ import annotations

import math

import pytest
import torch
from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor
from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
from compressed_tensors.quantization import preset_name_to_scheme
from compressed_tensors.quantization.lifecycle.forward import dequantize as ct_dequantize
from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam, maybe_pad_tensor_for_block_quant

from mtpkit.formats.dequantize import dequantize_weight, plan_modules
from mtpkit.formats.fp8 import FP8_E4M3_MAX, dequantize_fp8
from mtpkit.formats.nvfp4 import E2M1_VALUES, dequantize_nvfp4, unpack_fp4

SHAPES = [(64, 96), (200, 300)]  # the second is not a multiple of 128: partial edge blocks for FP8_BLOCK


def _ct_fp8(preset: str, shape: tuple[int, int], dtype: torch.dtype, seed: int = 0):
    """compressed-tensors' compressed FP8 tensors of a random weight, and its own decompression."""
    torch.manual_seed(seed)
    weight = torch.randn(shape, dtype=dtype)
    scheme = preset_name_to_scheme(preset, ["Linear"])
    args = scheme.weights
    if args.strategy == "tensor":
        lo, hi = torch.aminmax(weight)
    elif args.strategy == "channel":
        lo, hi = weight.amin(1, keepdim=True), weight.amax(1, keepdim=True)
    else:  # block: the min/max of every (zero-padded) 128x128 tile
        bh, bw = args.block_structure
        tiles = maybe_pad_tensor_for_block_quant(weight, (bh, bw)).unflatten(0, (-1, bh)).unflatten(-1, (-1, bw))
        lo, hi = tiles.amin((1, 3)), tiles.amax((1, 3))
    scale, _ = calculate_qparams(lo, hi, args)
    compressed = FloatQuantizationCompressor.compress({"weight": weight, "weight_scale": scale}, scheme)
    reference = FloatQuantizationCompressor.decompress(compressed, scheme)["weight"]
    return compressed, reference


def _ct_nvfp4(shape: tuple[int, int], seed: int = 0):
    """compressed-tensors' NVFP4 tensors (weight_packed, weight_scale, weight_global_scale) and the scheme."""
    torch.manual_seed(seed)
    weight = torch.randn(shape, dtype=torch.bfloat16) * 0.05
    scheme = preset_name_to_scheme("NVFP4", ["Linear"])
    lo, hi = torch.aminmax(weight.float())
    global_scale = generate_gparam(lo, hi)
    groups = weight.unflatten(-1, (-1, 16))
    scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights, global_scale=global_scale)
    state = {"weight": weight, "weight_scale": scale, "weight_global_scale": global_scale}
    return NVFP4PackedCompressor.compress(state, scheme), scheme


def _ct_float32(compressed, scheme, shape):
    """compressed-tensors' decompression math (its unpacker, its `dequantize`) run at float32."""
    codes = unpack_fp4_from_uint8(compressed["weight_packed"], *shape, dtype=torch.float32)
    return ct_dequantize(codes, compressed["weight_scale"].to(torch.float32), args=scheme.weights,
                         global_scale=compressed["weight_global_scale"], dtype=torch.float32)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("preset", "layout"), [("FP8", (1,)), ("FP8_DYNAMIC", "channel"), ("FP8_BLOCK", "block")])
def test_fp8_matches_compressed_tensors(preset, layout, shape, dtype):
    compressed, reference = _ct_fp8(preset, shape, dtype)
    (out, inp), ceil128 = shape, lambda n: -(-n // 128)
    expected_scale = {"channel": (out, 1), "block": (ceil128(out), ceil128(inp))}.get(layout, layout)
    assert tuple(compressed["weight_scale"].shape) == expected_scale
    ours = dequantize_weight(compressed, reference.dtype)
    # Bit-exact: one float32 product, one rounding, as compressed-tensors does.
    assert ours.dtype == reference.dtype and torch.equal(ours, reference)


def test_fp8_block_partial_edges_use_their_own_scale():
    compressed, reference = _ct_fp8("FP8_BLOCK", (200, 300), torch.float32, seed=1)
    scale = compressed["weight_scale"]
    assert tuple(scale.shape) == (2, 3)
    ours = dequantize_fp8(compressed["weight"], scale, torch.float32)
    assert torch.equal(ours, reference)
    # The partial corner tile (rows 128..199, cols 256..299) is the fp8 codes times scale[1, 2] and nothing else.
    corner = compressed["weight"][128:, 256:].float() * scale[1, 2]
    assert torch.equal(ours[128:, 256:], corner)


@pytest.mark.parametrize("shape", SHAPES[:1] + [(40, 64)])
def test_nvfp4_compressed_tensors_matches_its_decompress(shape):
    compressed, scheme = _ct_nvfp4(shape)
    reference = NVFP4PackedCompressor.decompress(compressed, scheme)["weight"]  # bfloat16, by its design
    ours = dequantize_weight(compressed, torch.bfloat16)
    assert torch.equal(ours, reference)
    # In float32 too, against compressed-tensors' own unpack + dequantize at float32: 0 ulp.
    assert torch.equal(dequantize_weight(compressed, torch.float32), _ct_float32(compressed, scheme, shape))


def test_nvfp4_modelopt_layout_matches_compressed_tensors():
    compressed, scheme = _ct_nvfp4((64, 96), seed=2)
    ref32 = _ct_float32(compressed, scheme, (64, 96))
    modelopt = {
        "weight": compressed["weight_packed"],  # same nibbles, same order
        "weight_scale": compressed["weight_scale"],  # same FP8 group scales
        "weight_scale_2": (1.0 / compressed["weight_global_scale"]).reshape(()),  # ModelOpt writes a 0-d scalar
        "input_scale": torch.tensor(0.01),
    }
    ours = dequantize_weight(modelopt, torch.float32)
    # s * (1/g) vs s / g: the reciprocal and the product each round once (<= 2^-24 relative each), the
    # division once, and each side's final multiply by the code once, so they can differ by about 4 * 2^-24;
    # rtol 2^-21 is that bound with a factor of 2 to spare. Zeros are exact on both sides, hence atol 0.
    torch.testing.assert_close(ours, ref32, rtol=2.0**-21, atol=0.0)
    direct = dequantize_nvfp4(modelopt["weight"], modelopt["weight_scale"], modelopt["weight_scale_2"],
                              convention="modelopt", dtype=torch.float32)
    assert torch.equal(direct, ours)


def test_unpack_low_nibble_is_even_column():
    packed = torch.tensor([[0x21, 0x8F]], dtype=torch.uint8)
    # 0x21: low nibble 1 -> column 0 = 0.5, high nibble 2 -> column 1 = 1.0; 0x8F: 15 -> -6.0, 8 -> -0.0.
    values = unpack_fp4(packed, 1, 4)
    assert values.tolist() == [[0.5, 1.0, -6.0, -0.0]]
    assert torch.signbit(values[0, 3])


def test_e2m1_table_matches_its_definition():
    # E2M1: 1 sign bit (0x8), 2 exponent bits with bias 1, 1 mantissa bit; exponent 0 is subnormal.
    for code in range(16):
        sign = -1.0 if code & 0x8 else 1.0
        exponent, mantissa = (code >> 1) & 0x3, code & 0x1
        magnitude = mantissa * 0.5 if exponent == 0 else 2.0 ** (exponent - 1) * (1 + mantissa / 2)
        assert E2M1_VALUES[code] == sign * magnitude and math.copysign(1.0, E2M1_VALUES[code]) == sign, code
    # Against compressed-tensors' unpacker as well: every byte 0..255 decodes the same.
    every = torch.arange(256, dtype=torch.uint8).reshape(16, 16)
    assert torch.equal(unpack_fp4(every, 16, 32), unpack_fp4_from_uint8(every, 16, 32, dtype=torch.float32))
    assert FP8_E4M3_MAX == torch.finfo(torch.float8_e4m3fn).max


def _nvfp4_ct():  # a consistent [4, 32] compressed-tensors NVFP4 module, for the tests to damage
    return {"weight_packed": torch.zeros(4, 16, dtype=torch.uint8),
            "weight_scale": torch.ones(4, 2, dtype=torch.float8_e4m3fn), "weight_global_scale": torch.ones(1)}


@pytest.mark.parametrize(("change", "message"), [
    (lambda t: t.pop("weight_global_scale"), "missing weight_global_scale"),
    (lambda t: t.pop("weight_scale"), "missing weight_scale"),
    (lambda t: t.update(weight_scale=torch.ones(4, 3, dtype=torch.float8_e4m3fn)), r"expected \[4, 2\]"),
    (lambda t: t.update(weight_packed=torch.zeros(4, 12, dtype=torch.uint8)), "not a multiple of the group size"),
    (lambda t: t.update(weight_global_scale=torch.ones(2)), "must be one float value"),
    (lambda t: t.update(weight_packed=torch.zeros(4, 16, dtype=torch.int8)), "must be uint8"),
    (lambda t: t.update(weight_scale_2=torch.ones(())), "mixes ModelOpt"),
    (lambda t: t.update(weight=torch.zeros(4, 32)), "both weight and weight_packed"),
    (lambda t: t.update(weight_zero_point=torch.zeros(4, 2)), "asymmetric"),
])
def test_nvfp4_errors_name_the_problem(change, message):
    tensors = _nvfp4_ct()
    change(tensors)
    with pytest.raises(ValueError, match=message) as info:
        dequantize_weight(tensors, name="model.layers.0.mlp.up_proj")
    assert "model.layers.0.mlp.up_proj" in str(info.value)


@pytest.mark.parametrize(("tensors", "message"), [
    ({"weight": torch.zeros(4, 32, dtype=torch.uint8), "weight_scale": torch.ones(4, 4, dtype=torch.float8_e4m3fn)},
     "ModelOpt NVFP4 weight in m is missing weight_scale_2"),
    ({"weight": torch.zeros(4, 8, dtype=torch.float8_e4m3fn)}, "FP8 weight in m is missing weight_scale"),
    ({"weight": torch.zeros(200, 300, dtype=torch.float8_e4m3fn), "weight_scale": torch.ones(2, 2)},
     r"fits no FP8 layout .*\[2, 3\]"),
    ({"weight": torch.zeros(4, 8), "weight_scale": torch.ones(1)}, "only belongs to a quantized"),
    ({"weight_scale": torch.ones(1)}, "no weight or weight_packed"),
    ({"weight": torch.zeros(4, 8, dtype=torch.int8)}, "dtype torch.int8"),
])
def test_other_errors_name_the_problem(tensors, message):
    with pytest.raises(ValueError, match=message):
        dequantize_weight(tensors, name="m")


def test_dense_weight_passes_through_and_dtype_is_checked():
    weight = torch.randn(3, 5)
    assert torch.equal(dequantize_weight({"weight": weight, "bias": torch.zeros(3)}, torch.float32), weight)
    with pytest.raises(ValueError, match="float dtype"):
        dequantize_weight({"weight": weight}, torch.int32)


def test_plan_modules_groups_names_and_drops_scales():
    names = [
        "model.layers.0.self_attn.q_proj.weight_packed", "model.layers.0.self_attn.q_proj.weight_scale",
        "model.layers.0.self_attn.q_proj.weight_global_scale", "model.layers.0.self_attn.q_proj.input_global_scale",
        "model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.up_proj.weight_scale",
        "model.layers.0.mlp.up_proj.weight_scale_2", "model.layers.0.mlp.up_proj.input_scale",
        "model.layers.0.self_attn.k_scale", "model.layers.0.self_attn.v_scale",
        "model.layers.0.input_layernorm.weight", "model.embed_tokens.weight", "model.layers.0.mlp.up_proj.bias",
    ]
    plans = plan_modules(names)
    assert sorted(plans) == ["model.layers.0.mlp.up_proj", "model.layers.0.self_attn",
                             "model.layers.0.self_attn.q_proj"]
    q = plans["model.layers.0.self_attn.q_proj"]
    assert q.quantized and q.weight_name == "model.layers.0.self_attn.q_proj.weight"
    assert q.drop == sorted(n for n in names if n.startswith("model.layers.0.self_attn.q_proj."))
    up = plans["model.layers.0.mlp.up_proj"]
    assert up.quantized and set(up.sources) == {"weight", "weight_scale", "weight_scale_2", "input_scale"}
    assert up.drop == ["model.layers.0.mlp.up_proj.input_scale", "model.layers.0.mlp.up_proj.weight_scale",
                       "model.layers.0.mlp.up_proj.weight_scale_2"]
    attn = plans["model.layers.0.self_attn"]
    assert not attn.quantized and attn.drop == ["model.layers.0.self_attn.k_scale", "model.layers.0.self_attn.v_scale"]


def test_modelopt_block_scale_keeps_its_reduced_axes():
    """ModelOpt's FP8_PB_WO stores the block scale as [out/128, 1, in/128, 1] (vLLM squeezes it): same values."""
    from mtpkit.formats.fp8 import dequantize_fp8, fp8_weight_scale, quantize_fp8

    torch.manual_seed(0)
    weight = torch.randn(256, 384)
    scale = fp8_weight_scale(weight, "block")
    codes = quantize_fp8(weight, scale)
    four_d = scale.reshape(scale.shape[0], 1, scale.shape[1], 1)
    assert torch.equal(dequantize_fp8(codes, four_d, torch.float32), dequantize_fp8(codes, scale, torch.float32))
    assert torch.equal(quantize_fp8(weight, four_d), codes)
