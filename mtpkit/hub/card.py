"""The model cards (README.md) of the two repos: Hub metadata, what was changed, acceptance, and usage.

Metadata follows the Hub's model-card spec: `base_model` (the source repo, when the source came from the
Hub), `base_model_relation: quantized` for a target mtpkit quantized, `library_name`, `pipeline_tag`,
`license` (carried over from the source's card) and `tags`. The text names the two repos in every usage
example, so each can be copied as it is.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import yaml

SCHEME_TEXT = {
    "fp8-dynamic": "FP8 weights; activations quantized to FP8 at run time",
    "fp8": "FP8 weights and activations, with calibrated (static) activation scales",
    "fp8-block": "FP8 weights in blocks; activations quantized to FP8 at run time",
    "nvfp4": "NVFP4 weights and activations, with calibrated activation scales",
    "nvfp4a16": "NVFP4 weights; 16-bit activations (weight-only)",
}
PROMPT = "Why is the sky blue?"


@dataclass(frozen=True)
class Side:
    """One repo of the pair: its id and where its files came from."""

    repo_id: str
    source_repo_id: str | None  # pair.json's origin repo_id: the card's base_model
    source_commit: str | None
    source_name: str  # shown when the source was a local folder (its name, never its full path)
    license: dict = field(default_factory=dict)  # license / license_name / license_link of the source card


@dataclass(frozen=True)
class CardContext:
    target: Side
    draft: Side
    endpoint: str  # for links: https://huggingface.co or HF_ENDPOINT
    revision: str
    num_speculative_tokens: int
    tokens_why: str
    quantization: dict | None  # detect_quantization of the written target
    quantized_by: dict | None  # pair.json target_quantized_by (the quantize report summary)
    kv_scales: bool
    draft_rules: list[dict]
    findings: list  # check findings now (warnings, and errors when pushed with --force)
    acceptance: dict | None  # normalized bench numbers, or None: not measured
    scrub: dict[str, str] = field(default_factory=dict)  # local paths -> what the card says instead


def read_front_matter(path: Path) -> dict:
    """The YAML metadata of a model card; {} when it has none or it does not parse."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return {}
    lines = text.splitlines()
    if not lines or lines[0].strip() != "---":
        return {}
    for end, line in enumerate(lines[1:], 1):
        if line.strip() == "---":
            try:
                data = yaml.safe_load("\n".join(lines[1:end]))
            except yaml.YAMLError:
                return {}
            return data if isinstance(data, dict) else {}
    return {}


def license_of(card: dict) -> dict:
    return {key: card[key] for key in ("license", "license_name", "license_link") if isinstance(card.get(key), (str, list))}


def _front_matter(metadata: dict) -> str:
    return "---\n" + yaml.safe_dump(metadata, sort_keys=False, allow_unicode=True, width=1000) + "---\n"


def _link(ctx: CardContext, repo_id: str) -> str:
    return f"[{repo_id}]({ctx.endpoint}/{repo_id})"


def _source(ctx: CardContext, side: Side) -> str:
    if side.source_repo_id:
        at = f" (commit `{side.source_commit}`)" if side.source_commit else ""
        return _link(ctx, side.source_repo_id) + at
    return f"a local folder (`{side.source_name}`)"


def _scrub(ctx: CardContext, text: str) -> str:
    for path, name in sorted(ctx.scrub.items(), key=lambda item: -len(item[0])):
        text = text.replace(path, name)
    return text


def _q(text: str) -> str:
    """A Python string literal in double quotes."""
    return json.dumps(text)


def _rev(ctx: CardContext) -> str | None:
    return None if ctx.revision == "main" else ctx.revision


def quantization_tags(quantization: dict | None, kv_scales: bool) -> list[str]:
    if not quantization:
        return []
    tags = []
    scheme = str(quantization.get("scheme", ""))
    for family in ("nvfp4", "fp8"):
        if scheme.startswith(family):
            tags.append(family)
            break
    method = quantization.get("method")
    if method in ("compressed-tensors", "modelopt"):
        tags.append(method)
    if kv_scales or quantization.get("kv_cache"):
        tags.append("fp8-kv-cache")
    return tags


def vllm_lines(ctx: CardContext) -> tuple[str, str]:
    """`vllm serve ...` and the Python LLM(...) lines, as pair.json writes them, with repo ids instead of folders."""
    t, d = ctx.target.repo_id, ctx.draft.repo_id
    spec: dict = {"model": d, "num_speculative_tokens": ctx.num_speculative_tokens}
    serve = f"vllm serve {shlex.quote(t)}"
    python = f"from vllm import LLM\n\nllm = LLM(model={_q(t)}"
    if _rev(ctx):
        spec["revision"] = ctx.revision
        serve += f" --revision {shlex.quote(ctx.revision)}"
        python += f", revision={_q(ctx.revision)}"
    serve += f" --speculative-config {shlex.quote(json.dumps(spec))}"
    python += f", speculative_config={json.dumps(spec)}"  # str and int values: JSON is Python here
    if ctx.kv_scales:
        serve += " --kv-cache-dtype fp8"
        python += ', kv_cache_dtype="fp8"'
    python += f")\nprint(llm.generate([{_q(PROMPT)}])[0].outputs[0].text)"
    return serve, python


def _transformers_usage(ctx: CardContext) -> str:
    if ctx.quantization and ctx.quantization.get("method") == "modelopt":
        return ("transformers does not load ModelOpt checkpoints: serve this pair with vLLM, or run it with mtpkit "
                "(below).\n")
    t, d = ctx.target.repo_id, ctx.draft.repo_id
    rev = f", revision={_q(ctx.revision)}" if _rev(ctx) else ""
    return (
        "```python\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
        f"tokenizer = AutoTokenizer.from_pretrained({_q(t)}{rev})\n"
        f"model = AutoModelForCausalLM.from_pretrained({_q(t)}{rev}, dtype=\"auto\", device_map=\"auto\")\n"
        f"assistant = AutoModelForCausalLM.from_pretrained({_q(d)}{rev}, dtype=\"auto\", device_map=\"auto\")\n"
        f"assistant.generation_config.num_assistant_tokens = {ctx.num_speculative_tokens}\n"
        f"messages = [{{\"role\": \"user\", \"content\": {_q(PROMPT)}}}]\n"
        "inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True,\n"
        "                                       return_tensors=\"pt\").to(model.device)\n"
        "output = model.generate(**inputs, assistant_model=assistant, max_new_tokens=128)\n"
        "print(tokenizer.decode(output[0, inputs[\"input_ids\"].shape[1]:], skip_special_tokens=True))\n"
        "```\n"
    )


def _usage(ctx: CardContext) -> str:
    t, d = ctx.target.repo_id, ctx.draft.repo_id
    serve, python = vllm_lines(ctx)
    rev_py = f", revision={_q(ctx.revision)}" if _rev(ctx) else ""
    rev_cli = f" --revision {shlex.quote(ctx.revision)}" if _rev(ctx) else ""
    kv = (" The target carries calibrated k/v scales, hence `--kv-cache-dtype fp8`." if ctx.kv_scales else "")
    return (
        "## Usage\n\n"
        f"The target is {_link(ctx, t)}; its assistant (the draft model) is {_link(ctx, d)}. "
        f"`num_speculative_tokens` {ctx.num_speculative_tokens}: {ctx.tokens_why}.{kv}\n\n"
        "### vLLM\n\n"
        f"```bash\n{serve}\n```\n\n"
        f"```python\n{python}\n```\n\n"
        "### transformers (assisted generation)\n\n"
        f"{_transformers_usage(ctx)}\n"
        "### mtpkit\n\n"
        "```python\n"
        "import mtpkit\n\n"
        f"pair = mtpkit.load_pair(target=\"{t}\", draft=\"{d}\"{rev_py})\n"
        f"print(pair.generate([{_q(PROMPT)}], max_new_tokens=128, chat=True)[0].text)\n"
        "```\n\n"
        "```bash\n"
        f"mtp-convert run --target {shlex.quote(t)} --draft {shlex.quote(d)}{rev_cli} --prompt {shlex.quote(PROMPT)} --chat\n"
        "```\n"
    )


def _acceptance(ctx: CardContext) -> str:
    text = "## Acceptance\n\n"
    a = ctx.acceptance
    if not a:
        return text + (f"Not measured. Measure it with `mtp-convert bench --target {ctx.target.repo_id} --draft "
                       f"{ctx.draft.repo_id}` (mtpkit's runtime), or from vLLM's speculative-decoding metrics.\n")
    text += f"Measured with {a['how']}.\n\n"
    text += "| k | mean acceptance length | accepted, by draft position | speedup |\n|---|---|---|---|\n"
    for row in a["rows"]:
        positions = " ".join(f"{100 * p:.0f}%" for p in row.get("per_position") or []) or "-"
        speedup = f"{row['speedup']:.2f}x" if isinstance(row.get("speedup"), (int, float)) else "-"
        text += f"| {row['k']} | {row['mean_acceptance_length']:.2f} | {positions} | {speedup} |\n"
    if a.get("recommended_k") is not None:
        text += f"\nFastest k in that run: {a['recommended_k']}.\n"
    return text


def _evaluation(ctx: CardContext, evaluation: dict | None) -> str:
    if not evaluation:
        return "- Evaluation: not recorded.\n"
    if "skipped" in evaluation:
        return f"- Evaluation: not run ({_scrub(ctx, str(evaluation['skipped']))}).\n"
    try:
        ppl = evaluation["perplexity"]
        line = (f"- Evaluation against the original on {evaluation['tokens']} tokens ({evaluation['samples']} samples), "
                f"run as served (activations {evaluation.get('activations', 'as served')}; KV cache "
                f"{evaluation.get('kv_cache', 'unquantized')}): max |logit error| {evaluation['max_abs_logit_error']:.4f}, "
                f"mean {evaluation['mean_abs_logit_error']:.5f}, top-1 agreement {100 * evaluation['top1_agreement']:.1f}%, "
                f"perplexity {ppl['original']:.3f} -> {ppl['quantized']:.3f}.\n")
    except (KeyError, TypeError, ValueError):
        return "- Evaluation: recorded in `mtpkit_quantize.json`.\n"
    return _scrub(ctx, line)


def _target_changes(ctx: CardContext) -> str:
    text = "### Target\n\n"
    q, by = ctx.quantization, ctx.quantized_by
    if by:
        scheme = str(by.get("scheme") or (q or {}).get("scheme"))
        fmt = by.get("format") or (q or {}).get("method")
        text += (f"- Source: {_source(ctx, ctx.target)}, quantized by `mtp-convert pair --quantize {scheme}`: "
                 f"{SCHEME_TEXT.get(scheme, scheme)}, in the {fmt} format")
        if by.get("quantized_modules") is not None:
            text += f" ({by['quantized_modules']} Linear modules)"
        text += ".\n"
        if q and q.get("ignore"):
            text += "- Kept unquantized: " + ", ".join(f"`{item}`" for item in q["ignore"]) + ".\n"
        if by.get("kv_cache"):
            text += f"- KV cache: {by['kv_cache']}, with calibrated per-layer k/v scales.\n"
        calibration = by.get("calibration")
        if isinstance(calibration, dict) and calibration:
            parts = [f"{calibration[key]} {key}" for key in ("samples", "tokens") if key in calibration]
            text += "- Calibration: " + (", ".join(parts) or "recorded in `mtpkit_quantize.json`") + ".\n"
        text += _evaluation(ctx, by.get("evaluation"))
        text += "- Per-layer weight errors: `mtpkit_quantize.json` in this repo.\n"
    elif q:
        text += (f"- The files of {_source(ctx, ctx.target)}, byte for byte (already quantized: "
                 f"{q.get('scheme')}, {q.get('method')}).\n")
    else:
        text += f"- The files of {_source(ctx, ctx.target)}, byte for byte (not quantized).\n"
    if not ctx.target.source_repo_id:
        text += ("- The source's Hub id was not recorded (it was converted from a local folder), so `base_model` is "
                 "not set; add it to this card's metadata if you know it.\n")
    return text


def _draft_changes(ctx: CardContext) -> str:
    text = "### Assistant\n\n"
    text += f"- Source: {_source(ctx, ctx.draft)}, rewritten by `mtp-convert draft` into the canonical form vLLM and " \
            "transformers load (BF16, no quantization config, architecture fields in `text_config`).\n"
    if ctx.draft_rules:
        text += "- Changes:\n"
        for rule in ctx.draft_rules:
            before, after = rule.get("before"), rule.get("after")
            before = before if isinstance(before, str) else json.dumps(before)
            after = after if isinstance(after, str) else json.dumps(after)
            text += _scrub(ctx, f"  - [{rule.get('rule')}] `{rule.get('path')}`: `{before}` -> `{after}` "
                                f"({rule.get('reason')})\n")
    else:
        text += "- No change was needed: the source was already canonical.\n"
    if not ctx.draft.source_repo_id:
        text += "- The source's Hub id was not recorded (a local folder), so `base_model` is not set.\n"
    return text


def _validation(ctx: CardContext) -> str:
    errors = [f for f in ctx.findings if f.severity == "error"]
    warnings = [f for f in ctx.findings if f.severity != "error"]
    text = "### Validation\n\n"
    if errors:
        text += (f"- **`mtp-convert check` FAILED with {len(errors)} error(s) when this pair was pushed (pushed "
                 "with `--force`); expect vLLM to reject the pair or accept no draft tokens:**\n")
    else:
        text += "- `mtp-convert check` passed" + (f" with {len(warnings)} warning(s):\n" if warnings else ".\n")
    for finding in errors + warnings:
        text += _scrub(ctx, f"  - {finding.severity} [{finding.id}] {finding.message}\n")
    return text


def _pair_table(ctx: CardContext) -> str:
    def base(side: Side) -> str:
        return _link(ctx, side.source_repo_id) if side.source_repo_id else "not recorded (local folder)"

    return ("## The pair\n\n| role | repository | converted from |\n|---|---|---|\n"
            f"| target | {_link(ctx, ctx.target.repo_id)} | {base(ctx.target)} |\n"
            f"| assistant (draft) | {_link(ctx, ctx.draft.repo_id)} | {base(ctx.draft)} |\n")


def target_card(ctx: CardContext) -> str:
    metadata: dict = {}
    if ctx.target.source_repo_id:
        metadata["base_model"] = ctx.target.source_repo_id
        if ctx.quantized_by:
            metadata["base_model_relation"] = "quantized"
    metadata.update(library_name="transformers", pipeline_tag="text-generation", **ctx.target.license)
    metadata["tags"] = ["speculative-decoding", "mtp", "gemma4", *quantization_tags(ctx.quantization, ctx.kv_scales),
                        "mtpkit"]
    name = ctx.target.repo_id.split("/", 1)[1]
    q = ctx.quantization
    what = f"{q.get('scheme')} ({q.get('method')})" if q else "BF16"
    body = (f"# {name}\n\n"
            f"A Gemma 4 target in {what}, published with its speculative-decoding assistant "
            f"{_link(ctx, ctx.draft.repo_id)} (multi-token prediction, MTP). Converted from "
            f"{_source(ctx, ctx.target)} and validated as a pair with mtpkit (`mtp-convert pair`, `mtp-convert push`).\n\n")
    body += _usage(ctx) + "\n" + _acceptance(ctx) + "\n## What was changed\n\n" + _target_changes(ctx) + "\n"
    body += _draft_changes(ctx) + "\n" + _validation(ctx) + "\n" + _pair_table(ctx)
    return _front_matter(metadata) + "\n" + body


def draft_card(ctx: CardContext) -> str:
    metadata: dict = {}
    if ctx.draft.source_repo_id:
        # A config rewrite of the same weights: no base_model_relation fits (not a fine-tune, adapter, merge or
        # quantization), so none is claimed.
        metadata["base_model"] = ctx.draft.source_repo_id
    metadata.update(library_name="transformers", pipeline_tag="text-generation", **ctx.draft.license)
    metadata["tags"] = ["speculative-decoding", "mtp", "gemma4", "gemma4-assistant", "mtpkit"]
    name = ctx.draft.repo_id.split("/", 1)[1]
    body = (f"# {name}\n\n"
            f"The speculative-decoding assistant (draft model, multi-token prediction) of {_link(ctx, ctx.target.repo_id)}. "
            "It drafts tokens from the target's hidden states and KV cache, so it is not a model on its own: "
            "load it as the draft of that target, as below. Converted from "
            f"{_source(ctx, ctx.draft)} with mtpkit (`mtp-convert pair`, `mtp-convert push`).\n\n")
    body += _usage(ctx) + "\n" + _acceptance(ctx) + "\n## What was changed\n\n" + _draft_changes(ctx) + "\n"
    body += _target_changes(ctx) + "\n" + _validation(ctx) + "\n" + _pair_table(ctx)
    return _front_matter(metadata) + "\n" + body


def normalize_acceptance(data: dict, where: str) -> dict | None:
    """Acceptance numbers from `mtp-convert bench --json` or `mtp-convert run --json` output; None if it has none."""
    if isinstance(data.get("results"), list) and data["results"] and isinstance(data["results"][0], dict) \
            and "k" in data["results"][0]:
        rows = [{"k": r["k"], "mean_acceptance_length": float(r["mean_acceptance_length"]),
                 "per_position": list(r.get("acceptance_per_position") or []), "speedup": r.get("speedup")}
                for r in data["results"] if int(r["k"]) > 0]
        how = (f"`mtp-convert bench` (mtpkit's PyTorch runtime) on {data.get('prompts', '?')} prompt(s), "
               f"{data.get('max_new_tokens', '?')} new tokens each, KV cache {data.get('kv_cache_dtype', '?')}, greedy; "
               "speedup is over the target alone in the same run, and vLLM's numbers may differ")
        return {"how": how, "rows": rows, "recommended_k": data.get("recommended_k")} if rows else None
    stats = data.get("stats")
    if isinstance(stats, dict) and "mean_acceptance_length" in stats:
        per_position = list(stats.get("acceptance_rate_per_position") or [])
        row = {"k": len(per_position) or "?", "mean_acceptance_length": float(stats["mean_acceptance_length"]),
               "per_position": per_position, "speedup": None}
        return {"how": "`mtp-convert run` (mtpkit's PyTorch runtime); vLLM's numbers may differ", "rows": [row],
                "recommended_k": None}
    return None
