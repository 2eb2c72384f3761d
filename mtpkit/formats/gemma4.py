"""Facts about Gemma 4 configs, read from the plain config dict (as it is on disk).

Targets (`gemma4` multimodal wrappers, `gemma4_text` decoders) nest their architecture in
`text_config` or not; assistants (`gemma4_assistant`) always should. Readers here look in the right
place and name the exact key when a value is missing or has the wrong type.
"""

from __future__ import annotations

from typing import Any

from mtpkit.errors import ConfigError, UnsupportedModelError

FAMILY = "gemma4"
TARGET_MODEL_TYPES = ("gemma4", "gemma4_text")
ASSISTANT_MODEL_TYPE = "gemma4_assistant"
# Written by tools that dumped an engine's in-memory form (vLLM renames assistants to this in memory);
# recognised so `inspect` can say what it is, but neither transformers nor vLLM loads it from disk.
NONCANONICAL_ASSISTANT_TYPES = ("gemma4_mtp",)
ATTENTION_TYPES = ("sliding_attention", "full_attention")
# Where a checkpoint keeps the text decoder: Gemma4ForConditionalGeneration nests it, Gemma4ForCausalLM does not.
TEXT_PREFIXES = ("model.language_model.", "model.")


def text_prefix(tensor_names) -> str:
    """The prefix of the text decoder's tensors in a checkpoint with these tensor names."""
    return next((p for p in TEXT_PREFIXES if any(n.startswith(p) for n in tensor_names)), TEXT_PREFIXES[-1])
# transformers' default when a config omits layer_types: five sliding layers, then one full.
_DEFAULT_SLIDING_PATTERN = 6
# Far above any Gemma 4 model (60 layers at most); a bound so a typo cannot make us build huge lists.
MAX_LAYERS = 10_000


def role_of(config: dict, where: str = "config.json") -> str:
    """'target' or 'assistant', from model_type; anything else is refused."""
    model_type = config.get("model_type")
    if model_type in TARGET_MODEL_TYPES:
        return "target"
    if model_type == ASSISTANT_MODEL_TYPE or model_type in NONCANONICAL_ASSISTANT_TYPES:
        return "assistant"
    known = ", ".join((*TARGET_MODEL_TYPES, ASSISTANT_MODEL_TYPE))
    raise UnsupportedModelError(
        f"model_type {model_type!r} is not a Gemma 4 model ({known})", where=where,
        fix="point at a Gemma 4 target or assistant checkpoint",
    )


def text_config_of(config: dict, where: str = "config.json") -> tuple[dict, str]:
    """The dict that holds the decoder architecture, and its key path for messages ('text_config.' or '')."""
    nested = config.get("text_config")
    if nested is None:
        return config, ""
    if not isinstance(nested, dict):
        raise ConfigError(f"text_config is a {type(nested).__name__}, not an object", where=where,
                          fix="restore the original config.json")
    return nested, "text_config."


def get_int(cfg: dict, key: str, *, prefix: str = "", where: str = "config.json", default: Any = ...,
            minimum: int = 0, maximum: int | None = None) -> int:
    """cfg[key] as an int in [minimum, maximum]; a missing key takes `default` (or is an error without one)."""
    if key not in cfg or cfg[key] is None:
        if default is ...:
            raise ConfigError(f"{prefix}{key} is missing", where=where, fix=f"add {prefix}{key} to the config")
        return default
    value = cfg[key]
    if type(value) is not int or value < minimum or (maximum is not None and value > maximum):
        expected = f"an integer from {minimum} to {maximum}" if maximum is not None else f"an integer >= {minimum}"
        raise ConfigError(f"{prefix}{key} is {value!r}, expected {expected}", where=where,
                          fix="restore the value from the original config")
    return value


def layer_types_of(text: dict, *, prefix: str = "", where: str = "config.json") -> list[str]:
    num_layers = get_int(text, "num_hidden_layers", prefix=prefix, where=where, minimum=1, maximum=MAX_LAYERS)
    layer_types = text.get("layer_types")
    if layer_types is None:
        # Mirror transformers' Gemma4TextConfig default, including its forced full last layer.
        layer_types = [
            "sliding_attention" if (i + 1) % _DEFAULT_SLIDING_PATTERN else "full_attention" for i in range(num_layers)
        ]
        layer_types[-1] = "full_attention"
        return layer_types
    if not (isinstance(layer_types, list) and all(t in ATTENTION_TYPES for t in layer_types)):
        raise ConfigError(f"{prefix}layer_types must be a list of {' / '.join(ATTENTION_TYPES)}", where=where,
                          fix="restore layer_types from the original config")
    if len(layer_types) != num_layers:
        raise ConfigError(
            f"{prefix}layer_types has {len(layer_types)} entries but {prefix}num_hidden_layers is {num_layers}",
            where=where, fix="make them agree (one layer type per layer)",
        )
    return list(layer_types)


def kv_producers(config: dict, where: str = "config.json") -> dict[str, int]:
    """For each attention type, the target layer whose K/V the assistant reads.

    That is the last layer of the type below `num_hidden_layers - num_kv_shared_layers`: layers from
    there on reuse earlier caches and compute no K/V of their own. Same rule as transformers'
    `Gemma4TextConfig.kv_sharing_modes` ('store') and vLLM's KV-sharing map.
    """
    text, prefix = text_config_of(config, where)
    layer_types = layer_types_of(text, prefix=prefix, where=where)
    num_layers = len(layer_types)
    shared = get_int(text, "num_kv_shared_layers", prefix=prefix, where=where, default=0)
    if shared >= num_layers:
        raise ConfigError(
            f"{prefix}num_kv_shared_layers is {shared}, but a target needs at least one layer that computes K/V "
            f"({prefix}num_hidden_layers is {num_layers})", where=where,
            fix="this looks like an assistant config; check model_type, or restore num_kv_shared_layers",
        )
    first_shared = num_layers - shared
    producers = {}
    for attention_type in ATTENTION_TYPES:
        if attention_type not in layer_types:
            continue
        below = [i for i in range(first_shared) if layer_types[i] == attention_type]
        if not below:
            raise ConfigError(
                f"no {attention_type} layer below layer {first_shared} computes K/V for the shared {attention_type} "
                f"layers", where=where, fix=f"restore {prefix}layer_types and {prefix}num_kv_shared_layers",
            )
        producers[attention_type] = below[-1]
    return producers


def assistant_fields(config: dict) -> dict[str, Any]:
    """The assistant-level fields as they stand at the top level (None where absent)."""
    keys = ("backbone_hidden_size", "use_ordered_embeddings", "num_centroids", "centroid_intermediate_top_k",
            "tie_word_embeddings")
    return {key: config.get(key) for key in keys}


# transformers' Gemma4TextConfig pops `global_head_dim` with this default when a config omits it.
DEFAULT_GLOBAL_HEAD_DIM = 512
DEFAULT_HEAD_DIM = 256


def _per_layer_overrides(per_layer: Any, prefix: str, where: str) -> dict[int, dict] | None:
    """per_layer_config keyed by int layer index (transformers writes zero-padded strings: "05", "11")."""
    if per_layer is None:
        return None
    if not isinstance(per_layer, dict):
        raise ConfigError(f"{prefix}per_layer_config is not an object", where=where, fix="restore it from the original")
    overrides = {}
    for key, value in per_layer.items():
        if not (isinstance(key, str) and key.isdigit() and isinstance(value, dict)):
            raise ConfigError(f"{prefix}per_layer_config.{key} is not a layer index mapped to an object", where=where,
                              fix="restore per_layer_config from the original")
        overrides[int(key)] = value
    return overrides


def per_layer_key(index: int, highest: int) -> str:
    """transformers' key spelling: zero-padded to the widest index present, so keys sort numerically."""
    return str(index).zfill(len(str(highest)))


def attention_geometry(text: dict, *, prefix: str = "", where: str = "config.json") -> dict[str, dict[str, Any]]:
    """Per attention type: head_dim, num_key_value_heads and k_eq_v, as transformers resolves them.

    Reads both dialects: Google's flat `global_head_dim` / `num_global_key_value_heads`, and the
    `per_layer_config` ({"<layer index>": {"head_dim": .., "num_key_value_heads": ..}}) that
    transformers >= 5.15 writes. Layers of one type must agree (Gemma 4 has one geometry per type).
    """
    layer_types = layer_types_of(text, prefix=prefix, where=where)
    head_dim = get_int(text, "head_dim", prefix=prefix, where=where, default=DEFAULT_HEAD_DIM, minimum=1)
    kv_heads = get_int(text, "num_key_value_heads", prefix=prefix, where=where, default=4, minimum=1)
    k_eq_v = text.get("attention_k_eq_v") is True
    per_layer = _per_layer_overrides(text.get("per_layer_config"), prefix, where)
    layers = []
    for index, layer_type in enumerate(layer_types):
        if per_layer is not None:
            override = per_layer.get(index, {})
            geometry = {"head_dim": override.get("head_dim", head_dim),
                        "num_key_value_heads": override.get("num_key_value_heads", kv_heads)}
        elif layer_type == "full_attention":
            global_kv = text.get("num_global_key_value_heads")
            geometry = {
                "head_dim": get_int(text, "global_head_dim", prefix=prefix, where=where,
                                    default=DEFAULT_GLOBAL_HEAD_DIM, minimum=1),
                # transformers applies the global KV-head count only together with attention_k_eq_v.
                "num_key_value_heads": global_kv if k_eq_v and global_kv is not None else kv_heads,
            }
        else:
            geometry = {"head_dim": head_dim, "num_key_value_heads": kv_heads}
        geometry["k_eq_v"] = k_eq_v and layer_type == "full_attention"
        layers.append((layer_type, geometry))
    result: dict[str, dict[str, Any]] = {}
    for layer_type, geometry in layers:
        if result.setdefault(layer_type, geometry) != geometry:
            raise ConfigError(f"{prefix}per_layer_config gives {layer_type} layers different head geometries",
                              where=where, fix="Gemma 4 uses one head_dim and KV-head count per attention type")
    return result
