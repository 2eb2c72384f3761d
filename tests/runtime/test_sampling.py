"""sampling.probabilities against the definitions; generate_sampled against the target's distribution.

The oracle for speculative sampling is its theorem: whatever the drafter proposes, each emitted token
is distributed as the target's (processed) distribution given the tokens before it. So the empirical
joint distribution of the first new tokens, over thousands of seeded rows of one prompt, must fit the
exact joint that the target's logits give by the chain rule. The first token comes from the target
alone (prefill); with k = 1 the second is an accepted draft or a residual sample, and the third a
bonus or the next round's, so three tokens cover every path. Two deliberately wrong rules (always
accept; resample from p instead of the residual) must fail the same check.

Fit check, per run: no row may leave the exact support, and (a) Pearson's chi-square over the support
(cells with expected count < 5 pooled) must have a p-value > ALPHA (asymptotic chi-square law), and
(b) the L1 distance must stay under the Bretagnolle-Huber-Carol bound
P(L1 >= lam) <= 2^m exp(-N lam^2 / 2) at probability ALPHA (exact for any N). A correct sampler thus
fails a run with probability <= 2 * ALPHA = 2e-6 over seeds; the seeds are fixed, so the outcome is too.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

import mtpkit.runtime.speculative_sampling as spec
from mtpkit.runtime import KVCache
from mtpkit.runtime.sampling import probabilities, sample
from mtpkit.runtime.speculative import generate_greedy
from mtpkit.runtime.speculative_sampling import generate_sampled
from tests.runtime.test_speculative import LENGTHS, PAIRS, load, prompts  # noqa: F401 (load: fixture)

ALPHA = 1e-6


def reference_probabilities(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The definitions, one row at a time, in float64."""
    out = torch.zeros(logits.shape, dtype=torch.float64)
    for r, row in enumerate(logits.double()):
        if temperature == 0:
            out[r, int(row.argmax())] = 1.0
            continue
        order = sorted(range(len(row)), key=lambda i: -float(row[i]))
        kept = order[:top_k] if top_k else order
        weights = torch.softmax(row[kept] / temperature, dim=0).tolist()  # kept is sorted by probability
        total, nucleus = 0.0, []
        for token, w in zip(kept, weights):
            nucleus.append((token, w))
            total += w
            if total >= top_p:
                break
        for token, w in nucleus:
            out[r, token] = w / total
    return out


SETTINGS = [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 5, 1.0), (1.3, 0, 0.8), (0.8, 10, 0.6), (1.0, 1, 1.0), (2.0, 0, 0.05)]


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), SETTINGS)
def test_probabilities_follow_the_definitions(temperature, top_k, top_p):
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(0)) * 3
    got = probabilities(logits, temperature, top_k, top_p)
    expected = reference_probabilities(logits, temperature, top_k, top_p)
    torch.testing.assert_close(got.double(), expected, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got.sum(-1), torch.ones(6))
    kept = got > 0
    if top_k and top_p == 1.0:
        assert (kept.sum(-1) == top_k).all()  # exactly k
    if top_p < 1.0:
        # Minimal: the kept tokens' untruncated mass reaches top_p, without the least of them it does not.
        untruncated = probabilities(logits, temperature, top_k)
        mass = (untruncated * kept).sum(-1)
        least = untruncated.masked_fill(~kept, 2.0).min(-1).values
        assert (mass >= top_p - 1e-6).all() and (mass - least < top_p).all()


def test_temperature_zero_is_argmax_and_scaling_is_softmax():
    logits = torch.randn(5, 30, generator=torch.Generator().manual_seed(1))
    greedy = probabilities(logits, 0.0, top_k=3, top_p=0.5)
    assert torch.equal(greedy, torch.nn.functional.one_hot(logits.argmax(-1), 30).float())
    torch.testing.assert_close(probabilities(logits, 0.5), torch.softmax(logits / 0.5, -1))
    masked = logits.clone()
    masked[:, ::2] = float("-inf")  # the centroid assistant's fill: such tokens get probability 0
    assert (probabilities(masked, 1.0, top_k=20)[:, ::2] == 0).all()
    for bad in [dict(temperature=-1.0), dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5)]:
        with pytest.raises(ValueError):
            probabilities(logits, **{"temperature": 1.0, **bad})


def test_sample_is_seeded_and_follows_probs():
    probs = torch.tensor([0.5, 0.0, 0.3, 0.2]).expand(20000, 4)
    draws = sample(probs, torch.Generator().manual_seed(0))
    assert torch.equal(draws, sample(probs, torch.Generator().manual_seed(0)))
    counts = torch.bincount(draws, minlength=4).double() / len(draws)
    assert counts[1] == 0
    torch.testing.assert_close(counts, probs[0].double(), atol=0.015, rtol=0)  # > 5 sigma


# --- the distribution of generate_sampled's tokens --------------------------------------------------------

def exact_joint(target, prompt: list[int], n: int, temperature: float, top_k: int, top_p: float) -> dict:
    """P(the first n new tokens are t) for every t in the support, by the chain rule over target forwards."""
    joint = {(): 1.0}
    for _ in range(n):
        seqs = [prompt + list(t) for t in joint]
        cache = KVCache(target.config, len(seqs), len(seqs[0]))
        ids = torch.tensor(seqs)
        with torch.inference_mode():
            hidden = target(ids, torch.arange(ids.shape[1]).expand_as(ids), cache)[:, -1]
            probs = probabilities(target.logits(hidden), temperature, top_k, top_p).double()
        joint = {t + (v,): w * float(probs[i, v]) for i, (t, w) in enumerate(joint.items())
                 for v in probs[i].nonzero()[:, 0].tolist()}
    return joint


def misfit(samples: list[tuple], joint: dict) -> str | None:
    """Why `samples` do not fit `joint` (module docstring), or None."""
    counts, n = Counter(samples), len(samples)
    outside = sum(c for t, c in counts.items() if t not in joint)
    if outside:
        return f"{outside} rows outside the support"
    cells = sorted(joint, key=joint.get)
    expected = [n * joint[t] for t in cells]
    observed = [counts[t] for t in cells]
    small = sum(1 for e in expected if e < 5)  # pool these (the least likely) into one cell
    if small:
        expected = [sum(expected[:small])] + expected[small:]
        observed = [sum(observed[:small])] + observed[small:]
    chi2 = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    pvalue = chi2_sf(chi2, len(expected) - 1)
    l1 = sum(abs(counts[t] / n - p) for t, p in joint.items())
    bound = math.sqrt(2 * (len(joint) * math.log(2) + math.log(1 / ALPHA)) / n)
    if pvalue <= ALPHA or l1 >= bound:
        return f"chi2 {chi2:.1f} on {len(expected) - 1} df (p {pvalue:.2g}), L1 {l1:.3f} (bound {bound:.3f})"
    return None


def chi2_sf(x: float, df: int) -> float:
    """P(chi2_df >= x) = 1 - P(df/2, x/2), the regularised lower incomplete gamma by its series."""
    a, y = df / 2, x / 2
    if y <= 0:
        return 1.0
    term = math.exp(a * math.log(y) - y - math.lgamma(a + 1))
    total, i = term, 0
    while term > 1e-17 * total:
        i += 1
        term *= y / (a + i)
        total += term
    return max(0.0, 1.0 - total)


# Small top_k keeps the joint of 3 tokens at <= 64 cells. These tiny random models are near-uniform, so
# the target's and the real assistant's top-k sets rarely overlap: its drafts are nearly all rejected.
# FixedDrafter makes both paths common: it proposes from the target's marginal distribution of the
# second new token, whatever the context, so each context's top-k shares about one token with it.
CASES = [("e2b_like", "assistant_centroids", 3000, dict(temperature=1.0, top_k=4, top_p=1.0)),
         ("dense_31b_like", "assistant_plain", 3000, dict(temperature=0.7, top_k=6, top_p=0.6))]
NEW = 3


class FixedDrafter:
    """The assistant's interface with the same logits at every step (log of `weights`)."""

    def __init__(self, weights: torch.Tensor):
        self.row = weights.float().log()

    def __call__(self, token_embedding, hidden, position, target_cache, target_config):
        return hidden, hidden

    def logits(self, normed, fill=None):
        return self.row.expand(normed.shape[0], -1)


def draws(load, target: str, drafter: str | None, rows: int, settings: dict, seed: int = 0):
    """(rows of the first NEW tokens, stats, exact joint) for `drafter`: an assistant's name, "fixed" or None."""
    model = load(target)
    prompt = prompts(6, seed=5)[0]
    joint = exact_joint(model, prompt, NEW, **settings)
    if drafter == "fixed":
        weights = torch.zeros(model.config.vocab_size, dtype=torch.float64)
        for t, w in joint.items():
            weights[t[1]] += w
        drafter = FixedDrafter(weights)
    elif drafter is not None:
        drafter = load(drafter)
    out, stats = generate_sampled(model, model.config, [prompt] * rows, max_new_tokens=NEW, assistant=drafter,
                                  num_speculative_tokens=1, seed=seed, **settings)
    return [tuple(o) for o in out], stats, joint


@pytest.mark.parametrize("drafter", ["assistant", "fixed", None])
@pytest.mark.parametrize(("target", "assistant", "rows", "settings"), CASES)
def test_tokens_follow_the_target_distribution(load, target, assistant, rows, settings, drafter):
    samples, stats, joint = draws(load, target, assistant if drafter == "assistant" else drafter, rows, settings)
    assert misfit(samples, joint) is None
    if drafter == "fixed":  # both paths are common: accepted drafts and rejections
        assert 0.1 < stats.acceptance_rate_per_position[0] < 0.9


@pytest.mark.parametrize("wrong", ["always_accept", "resample_from_p"])
def test_a_wrong_rule_fails_the_same_check(load, monkeypatch, wrong):
    target, _, rows, settings = CASES[0]
    if wrong == "always_accept":
        monkeypatch.setattr(spec, "_accepts", lambda p, q, u: torch.ones_like(u, dtype=torch.bool))
    else:
        monkeypatch.setattr(spec, "_residual", lambda p, q: p)
    samples, _, joint = draws(load, target, "fixed", rows, settings)
    assert misfit(samples, joint) is not None


def test_same_seed_same_tokens(load):
    target, assistant = PAIRS[0]
    model, seqs = load(target), prompts(*LENGTHS)

    def run(seed):
        return generate_sampled(model, model.config, seqs, max_new_tokens=16, assistant=load(assistant),
                                num_speculative_tokens=3, seed=seed, temperature=1.0)[0]

    assert run(7) == run(7)
    assert run(7) != run(8)


@pytest.mark.parametrize("k", [0, 1, 3])
@pytest.mark.parametrize(("target", "assistant"), PAIRS)
def test_temperature_zero_equals_greedy(load, target, assistant, k):
    model, seqs = load(target), prompts(*LENGTHS)
    greedy, _ = generate_greedy(model, model.config, seqs, max_new_tokens=20, assistant=load(assistant),
                                num_speculative_tokens=max(k, 1))
    got, stats = generate_sampled(model, model.config, seqs, max_new_tokens=20,
                                  assistant=load(assistant) if k else None, num_speculative_tokens=k,
                                  temperature=0.0, top_k=3, top_p=0.5, seed=3)
    assert got == greedy
    assert stats.tokens_generated == 20 * len(seqs)


@pytest.mark.parametrize("k", [0, 2])
def test_stops_and_stats(load, k):
    target, assistant = PAIRS[1]
    model, seqs = load(target), prompts(*LENGTHS, seed=2)
    kw = dict(max_new_tokens=25, assistant=load(assistant), num_speculative_tokens=k, seed=1, top_k=8)
    full, _ = generate_sampled(model, model.config, seqs, **kw)
    stop = full[0][4]
    got, stats = generate_sampled(model, model.config, seqs, stop_token_ids=[stop], **kw)
    # Same seed, same draws up to the stop: each output is the full one cut after its first stop.
    assert got == [out[:out.index(stop) + 1] if stop in out else out for out in full]
    assert stats.tokens_generated == sum(map(len, got))
    assert stats.sequence_rounds == sum(map(len, stats.accepted_lengths))
    for out, lengths in zip(got, stats.accepted_lengths):
        assert len(out) <= 1 + sum(a + 1 for a in lengths) and all(0 <= a <= k for a in lengths)
