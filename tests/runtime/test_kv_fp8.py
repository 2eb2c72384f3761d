"""The FP8 E4M3 KV cache: the quantization formula, the scales, the error it costs, speculative decoding on it.

The oracle for a cache entry is vLLM's formula computed by hand: clamp(x / scale, -448, 448) as
float8_e4m3fn, read back as fp8.float() * scale, with scale = amax / 448 when computed at prefill.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from mtpkit.runtime import Gemma4Assistant, Gemma4TextModel, KVCache, TextConfig, load_assistant_state_dict
from mtpkit.runtime import load_text_state_dict
from mtpkit.runtime.speculative import generate_greedy
from tests.runtime.test_speculative import FirstDraftTrue, OracleDrafter

FP8 = torch.float8_e4m3fn
TARGETS = ["e2b_like", "moe_26b_like", "dense_31b_like", "multimodal", "text_only"]
PAIRS = [("e2b_like", "assistant_centroids"), ("dense_31b_like", "assistant_plain")]
LENGTHS = [13, 4, 21, 9]  # 13 and 21 pass the fixtures' sliding window (8)


def _json(folder) -> dict:
    return json.loads((folder / "config.json").read_text())


@pytest.fixture(scope="module")
def load(tiny):
    """load(name) -> our float32 target or assistant, loaded once per module."""
    loaded = {}

    def get(name: str):
        if name not in loaded:
            config, tensors = _json(tiny(name)), load_file(tiny(name) / "model.safetensors")
            if name.startswith("assistant"):
                model = Gemma4Assistant(config).eval()
                load_assistant_state_dict(model, tensors)
            else:
                model = Gemma4TextModel(TextConfig.from_dict(config)).eval()
                load_text_state_dict(model, tensors)
            loaded[name] = model
        return loaded[name]

    return get


def oracle(x: torch.Tensor, scale: float) -> torch.Tensor:
    return (x.float() / scale).clamp(-448, 448).to(FP8).float() * scale


def owners(config: TextConfig) -> list[int]:
    return [i for i in range(config.num_hidden_layers) if not config.is_kv_shared(i)]


def record(cache: KVCache) -> dict[int, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Wrap cache.update to keep, per layer, the k, v of each write (before quantization)."""
    written: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    update = cache.update

    def recording(layer, positions, k, v):
        written.setdefault(layer, []).append((k.clone(), v.clone()))
        return update(layer, positions, k, v)

    cache.update = recording
    return written


# --- entries and scales ---------------------------------------------------------------------------

def test_entries_follow_the_formula_and_saturate(load):
    config = load("e2b_like").config
    layer, scale = owners(config)[0], 0.01
    cache = KVCache(config, 2, 8, dtype=FP8, k_scales={layer: scale}, v_scales={layer: scale * 2})
    heads, dim = cache.k[layer].shape[1], cache.k[layer].shape[3]
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, heads, 3, dim, generator=g), torch.randn(2, heads, 3, dim, generator=g)
    k[0, 0, 0, :2] = torch.tensor([10.0, -10.0])  # past 448 * 0.01 = 4.48: saturates at +-4.48
    positions = torch.tensor([[0, 1, 2], [4, 5, 6]])
    k_all, v_all = cache.update(layer, positions, k, v)

    assert cache.k[layer].dtype == FP8 and k_all.dtype == torch.float32
    for row, slots in enumerate(positions.tolist()):
        torch.testing.assert_close(k_all[row, :, slots], oracle(k[row], scale), rtol=0, atol=0)
        torch.testing.assert_close(v_all[row, :, slots], oracle(v[row], scale * 2), rtol=0, atol=0)
        assert torch.equal(cache.k[layer][row, :, slots].float(), (k[row] / scale).clamp(-448, 448).to(FP8).float())
    assert k_all[0, 0, 0, :2].tolist() == pytest.approx([448 * scale, -448 * scale])
    assert not k_all[0, :, 3:].any() and not k_all[1, :, :4].any()  # unwritten slots stay zero
    assert torch.equal(cache.read(layer)[0], k_all) and torch.equal(cache.read(layer)[1], v_all)


def test_scales_computed_at_prefill_are_the_amax_per_layer_then_frozen(load):
    model = load("e2b_like")
    config = model.config
    cache = KVCache(config, 2, 16, dtype=FP8)
    written = record(cache)
    ids = torch.randint(3, 120, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        model(ids, torch.arange(10).expand(2, -1), cache)  # the prefill sets every owning layer's scales
    prefill = {i: (cache.k_scale[i].clone(), cache.v_scale[i].clone()) for i in owners(config)}
    assert sorted(written) == owners(config)  # KV-shared layers write nothing
    for layer, [(k, v)] in written.items():
        torch.testing.assert_close(prefill[layer][0], k.abs().amax() / 448, rtol=0, atol=0)
        torch.testing.assert_close(prefill[layer][1], v.abs().amax() / 448, rtol=0, atol=0)
    assert len({float(k) for k, _ in prefill.values()}) == len(prefill)  # one scale per layer, not shared

    # Frozen: a later write ten times the prefill's amax keeps the scale and saturates at 448 * scale.
    layer = owners(config)[0]
    k, v = written[layer][0]
    k_all, _ = cache.update(layer, torch.tensor([[10], [10]]), 10 * k[:, :, :1], v[:, :, :1])
    assert torch.equal(cache.k_scale[layer], prefill[layer][0])
    assert k_all[:, :, 10].abs().max() == 448 * prefill[layer][0]


@pytest.mark.parametrize("form", ["dict", "list", "partial"])
def test_given_scales_are_used_as_given(load, form):
    model = load("dense_31b_like")
    config = model.config
    layers = owners(config)
    given = {i: torch.tensor([0.003 * (i + 1)]) for i in layers}  # shaped [1], as some checkpoints store them
    if form == "dict":
        k_scales, v_scales = given, {i: 2 * s for i, s in given.items()}
    elif form == "list":
        k_scales = [given.get(i) for i in range(config.num_hidden_layers)]
        v_scales = [None if s is None else 2 * s for s in k_scales]
    else:
        k_scales, v_scales = {layers[0]: given[layers[0]]}, None  # the rest computed at prefill
    cache = KVCache(config, 1, 8, dtype=FP8, k_scales=k_scales, v_scales=v_scales)
    written = record(cache)
    with torch.inference_mode():
        model(torch.tensor([[5, 6, 7, 8]]), torch.arange(4)[None], cache)
    for layer in layers:
        [(k, v)] = written[layer]
        k_expected = float(given[layer]) if form != "partial" or layer == layers[0] else k.abs().amax() / 448
        v_expected = 2 * float(given[layer]) if form != "partial" else v.abs().amax() / 448
        torch.testing.assert_close(cache.k_scale[layer], torch.as_tensor(k_expected), rtol=0, atol=0)
        torch.testing.assert_close(cache.v_scale[layer], torch.as_tensor(v_expected), rtol=0, atol=0)
        torch.testing.assert_close(cache.read(layer)[0][0, :, :4], oracle(k[0], float(cache.k_scale[layer])),
                                   rtol=0, atol=0)


def test_bad_scales_are_refused(load):
    config = load("e2b_like").config
    shared = next(i for i in range(config.num_hidden_layers) if config.is_kv_shared(i))
    with pytest.raises(ValueError, match="need dtype"):
        KVCache(config, 1, 4, dtype=torch.bfloat16, k_scales={0: 1.0})
    with pytest.raises(ValueError, match="KV-shared"):
        KVCache(config, 1, 4, dtype=FP8, k_scales={shared: 1.0})
    with pytest.raises(ValueError, match="positive finite"):
        KVCache(config, 1, 4, dtype=FP8, v_scales={0: 0.0})
    with pytest.raises(ValueError, match="no layer"):
        KVCache(config, 1, 4, dtype=FP8, v_scales={99: 1.0})
    with pytest.raises(ValueError, match="one per layer"):
        KVCache(config, 1, 4, dtype=FP8, k_scales={0: torch.ones(2)})


def test_bytes_per_token_fp8_is_half_bf16(load):
    for name in TARGETS:
        config = load(name).config
        per_layer = [2 * config.spec(i).num_key_value_heads * config.spec(i).head_dim for i in owners(config)]
        sizes = {dtype: KVCache(config, 3, 5, dtype=dtype).bytes_per_token()
                 for dtype in (torch.float32, torch.bfloat16, FP8)}
        assert sizes[FP8] == sum(per_layer) and sizes[torch.bfloat16] == 2 * sizes[FP8]
        assert sizes[torch.float32] == 4 * sizes[FP8]


# --- what the readers see -------------------------------------------------------------------------

@pytest.mark.parametrize(("target", "assistant"), PAIRS)
def test_shared_layers_and_the_assistant_read_the_dequantized_cache(load, target, assistant):
    """The draft over an FP8 cache equals the draft over a float32 cache holding the dequantized
    values: it reads K/V through KVCache.read, with the producer layers' scales."""
    model, draft = load(target), load(assistant)
    ids = torch.randint(3, 120, (2, 13), generator=torch.Generator().manual_seed(2))
    fp8 = KVCache(model.config, 2, 16, dtype=FP8)
    with torch.inference_mode():
        hidden = model(ids, torch.arange(13).expand(2, -1), fp8)[:, -1]
    plain = KVCache(model.config, 2, 16)
    for layer in range(model.config.num_hidden_layers):
        k, v = fp8.read(layer)
        torch.testing.assert_close(fp8.read(model.config.kv_source[layer])[0], k, rtol=0, atol=0)
        if plain.k[layer] is not None:
            plain.k[layer].copy_(k)
            plain.v[layer].copy_(v)
    position = torch.tensor([13, 13])
    embedding = model.embed(torch.tensor([[7], [9]]))[:, 0]
    with torch.inference_mode():
        got = draft(embedding, hidden, position, fp8, model.config)
        expected = draft(embedding, hidden, position, plain, model.config)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# --- end to end -----------------------------------------------------------------------------------

# Logits of an FP8 cache against a float32 one, as a relative Frobenius error ||fp8 - fp32|| / ||fp32||.
# E4M3 rounds K/V to 3 mantissa bits (relative error up to 2^-4), bf16 to 8 (2^-8 as stored here,
# relative 2^-9 max): to first order the logit error scales with it, and these random fixtures amplify
# it strongly. Measured on them: a bf16 cache 0.6-1.5% (6% on the MoE, where a perturbation flips the
# router's top-k), an FP8 cache 10-24% (36% on the MoE), about 16x bf16's. The bound 0.5 leaves room
# for routing flips. Scales 4x too small (every K/V above a quarter of its amax saturates, as a wrong
# layer's or a wrongly converted scale does when layers' ranges differ) give 0.77-1.2 on every fixture.
# E4M3 is a floating-point format: any scale keeping the values between 2^-6 and 448 rounds them with
# the same relative precision, so scale 1.0 (vLLM's default) or another layer's scale of similar range
# stays within the bound (measured 10-27%) and a bound cannot, and need not, tell them apart.
REL_BOUND = 0.5


def relative_error(model, **fp8_kwargs) -> tuple[float, KVCache]:
    """Prefill 12 tokens (past the sliding window), then a chunk of 8, with each cache; the FP8 cache too."""
    ids = torch.randint(3, 120, (2, 20), generator=torch.Generator().manual_seed(0))
    logits, caches = [], [KVCache(model.config, 2, 24), KVCache(model.config, 2, 24, dtype=FP8, **fp8_kwargs)]
    for cache in caches:
        with torch.inference_mode():
            logits.append(torch.cat([model.logits(model(ids[:, a:b], torch.arange(a, b).expand(2, -1), cache))
                                     for a, b in ((0, 12), (12, 20))], dim=1))
    reference, fp8 = logits
    return float((fp8 - reference).norm() / reference.norm()), caches[1]


@pytest.mark.parametrize("name", TARGETS)
def test_fp8_logits_stay_close_to_float32(load, name):
    model = load(name)
    error, cache = relative_error(model)
    assert error < REL_BOUND

    # The bound has teeth: the prefill's own scales divided by 4 saturate K/V and break it.
    layers = owners(model.config)
    error, _ = relative_error(model, k_scales={i: cache.k_scale[i] / 4 for i in layers},
                              v_scales={i: cache.v_scale[i] / 4 for i in layers})
    assert error > REL_BOUND


@pytest.mark.parametrize("first_true", [False, True])
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("k", range(1, 9))
@pytest.mark.parametrize(("target", "assistant"), PAIRS)
def test_speculative_equals_target_only_on_an_fp8_cache(load, target, assistant, k, batch, first_true):
    """Only the target's argmax over the same FP8 cache is emitted, so the outputs must match. The
    baseline runs the same batch: the prefill's scales come from the whole (padded) batch's amax.
    The random pairs accept almost no drafts, so first_true makes each round's first draft the
    target's own token (test_speculative's FirstDraftTrue): rounds then start after accepted drafts."""
    model, seqs = load(target), [torch.randint(3, 120, (n,), generator=torch.Generator().manual_seed(n)).tolist()
                                  for n in LENGTHS[:batch]]
    kw = {"cache_dtype": FP8}
    expected, _ = generate_greedy(model, model.config, seqs, max_new_tokens=24, **kw)
    drafter = load(assistant)
    if first_true:  # the truth must reach past the last round's drafts
        truth, _ = generate_greedy(model, model.config, seqs, max_new_tokens=24 + k + 2, **kw)
        rows = [s + t for s, t in zip(seqs, truth)]
        width = max(map(len, rows))
        drafter = FirstDraftTrue(drafter, OracleDrafter([row + [0] * (width - len(row)) for row in rows], k))
    got, stats = generate_greedy(model, model.config, seqs, max_new_tokens=24, assistant=drafter,
                                 num_speculative_tokens=k, **kw)
    assert got == expected
    assert stats.rounds > 0 and len(stats.acceptance_rate_per_position) == k
    if first_true:
        assert all(a >= 1 for lengths in stats.accepted_lengths for a in lengths)
