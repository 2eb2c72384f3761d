"""Glue from configs and tensors to runtime objects: `load_pair`, `load_target`, `load_draft`."""

from mtpkit.loader.load import load_draft, load_target
from mtpkit.loader.pair import Generation, Pair, load_pair

__all__ = ["Generation", "Pair", "load_draft", "load_pair", "load_target"]
