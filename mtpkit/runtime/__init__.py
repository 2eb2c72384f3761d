"""Plain PyTorch execution of a target + assistant pair; no file I/O."""

from mtpkit.runtime.assistant import Gemma4Assistant, load_assistant_state_dict
from mtpkit.runtime.config import AttentionSpec, TextConfig
from mtpkit.runtime.kv_cache import KVCache
from mtpkit.runtime.linears import QuantizedLinear, swap_quantized_linears
from mtpkit.runtime.model import Gemma4TextModel
from mtpkit.runtime.sampling import probabilities, sample
from mtpkit.runtime.speculative import GenerationStats, generate_greedy
from mtpkit.runtime.speculative_sampling import generate_sampled
from mtpkit.runtime.weights import load_text_state_dict

__all__ = [
    "AttentionSpec", "Gemma4Assistant", "Gemma4TextModel", "GenerationStats", "KVCache", "QuantizedLinear",
    "TextConfig", "generate_greedy", "generate_sampled", "load_assistant_state_dict", "load_text_state_dict",
    "probabilities", "sample", "swap_quantized_linears",
]
