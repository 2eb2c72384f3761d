"""KV producers and config readers, against transformers' Gemma4TextConfig and the published pairs."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoConfig, Gemma4TextConfig

from mtpkit.errors import ConfigError, UnsupportedModelError
from mtpkit.formats.gemma4 import kv_producers, layer_types_of, role_of
from tests.conftest import EXAMPLES

# Published KV producers (sliding / full) of the four public pairs.
PUBLISHED = {"E2B": (13, 14), "E4B": (22, 23), "26B-A4B": (28, 29), "31B": (58, 59)}


def _store_layers(config: Gemma4TextConfig) -> dict[str, int]:
    modes = config.kv_sharing_modes
    return {config.layer_types[i]: i for i, mode in enumerate(modes) if mode == "store"}


@pytest.mark.parametrize("model", PUBLISHED)
def test_reference_configs_give_the_published_producers(model):
    config = json.loads((EXAMPLES / f"gemma-4-{model}-it" / "config.json").read_text())
    sliding, full = PUBLISHED[model]
    assert kv_producers(config) == {"sliding_attention": sliding, "full_attention": full}
    # transformers marks the same layers "store" (it keeps their K/V for the assistant).
    text = AutoConfig.from_pretrained(EXAMPLES / f"gemma-4-{model}-it").get_text_config()
    assert _store_layers(text) == kv_producers(config)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(["sliding_attention", "full_attention"]), min_size=1, max_size=14), st.data())
def test_producers_match_transformers_kv_sharing_modes(layer_types, data):
    layer_types = layer_types[:-1] + ["full_attention"]  # transformers forces a full last layer
    shared = data.draw(st.integers(0, len(layer_types) - 1))
    config = {"model_type": "gemma4_text", "num_hidden_layers": len(layer_types), "layer_types": layer_types,
              "num_kv_shared_layers": shared}
    reference = Gemma4TextConfig(num_hidden_layers=len(layer_types), layer_types=layer_types,
                                 num_kv_shared_layers=shared)
    try:
        expected = _store_layers(reference)
    except ValueError:
        with pytest.raises(ConfigError, match="computes K/V"):
            kv_producers(config)
        return
    assert kv_producers(config) == expected


def test_missing_layer_types_default_like_transformers():
    config = {"model_type": "gemma4_text", "num_hidden_layers": 14}
    assert layer_types_of(config) == Gemma4TextConfig(num_hidden_layers=14).layer_types


@pytest.mark.parametrize(("config", "message"), [
    ({"model_type": "gemma4_text", "num_hidden_layers": "35"}, "num_hidden_layers is '35'"),
    ({"model_type": "gemma4", "text_config": {"num_hidden_layers": 2, "layer_types": ["full_attention"]}},
     "text_config.layer_types has 1 entries but text_config.num_hidden_layers is 2"),
    ({"model_type": "gemma4_text", "num_hidden_layers": 2, "num_kv_shared_layers": 2,
      "layer_types": ["sliding_attention", "full_attention"]}, "num_kv_shared_layers is 2"),
    ({"model_type": "gemma4", "text_config": {"num_hidden_layers": 1, "layer_types": ["global"]}},
     "text_config.layer_types must be"),
    ({"model_type": "gemma4", "text_config": []}, "text_config is a list"),
])
def test_bad_configs_name_the_key(config, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        kv_producers(config, "x/config.json")


def test_roles():
    assert role_of({"model_type": "gemma4"}) == role_of({"model_type": "gemma4_text"}) == "target"
    assert role_of({"model_type": "gemma4_assistant"}) == role_of({"model_type": "gemma4_mtp"}) == "assistant"
    with pytest.raises(UnsupportedModelError, match="'llama' is not a Gemma 4 model"):
        role_of({"model_type": "llama"})
