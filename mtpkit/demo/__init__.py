"""mtpkit's demo pair: a small Gemma 4 target and its MTP assistant, trained on the Python standard library.

Random weights accept no drafts; this pair shows speculative decoding working end to end on a laptop CPU:

    import mtpkit
    from mtpkit import demo

    pair = mtpkit.load_pair(target=demo.TARGET, draft=demo.ASSISTANT, dtype="float32")
    out = pair.generate(demo.heldout_prompts()[:4], max_new_tokens=64, num_speculative_tokens=4)

TRAINING.md says how it was made (scripts/train_demo_pair.py) and what it measures.
"""

from __future__ import annotations

import json
from pathlib import Path

_HERE = Path(__file__).resolve().parent

TARGET = _HERE / "target"  # Gemma4ForCausalLM (gemma4_text), bfloat16
ASSISTANT = _HERE / "assistant"  # Gemma4AssistantForCausalLM (gemma4_assistant), bfloat16
HELDOUT = _HERE / "heldout.jsonl"  # {"prompt": ..., "source": ...} from standard-library files held out of training


def heldout_prompts() -> list[str]:
    """The held-out prompts, in file order (the first lines of functions the pair never saw)."""
    return [json.loads(line)["prompt"] for line in HELDOUT.read_text(encoding="utf-8").splitlines() if line.strip()]


__all__ = ["ASSISTANT", "HELDOUT", "TARGET", "heldout_prompts"]
