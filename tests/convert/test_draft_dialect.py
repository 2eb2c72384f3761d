"""`draft --dialect per-layer` writes per_layer_config exactly as transformers' own save_pretrained spells it."""

from __future__ import annotations

import json
import shutil

import pytest
from transformers import AutoConfig

from tests.conftest import EXAMPLES


def _transformers_spelling(folder, tmp_path):
    saved = tmp_path / "saved-by-transformers"
    AutoConfig.from_pretrained(folder).save_pretrained(saved)
    return json.loads((saved / "config.json").read_text())["text_config"]["per_layer_config"]


@pytest.mark.parametrize("model", ["E2B", "E4B", "26B-A4B", "31B", "homogeneous"])
def test_per_layer_dialect_matches_transformers(cli, tmp_path, model):
    src = tmp_path / "src"
    shutil.copytree(EXAMPLES / f"gemma-4-{'E2B' if model == 'homogeneous' else model}-it-assistant", src)
    if model == "homogeneous":  # full layers with the sliding head_dim: transformers writes {}
        config = json.loads((src / "config.json").read_text())
        config["text_config"]["global_head_dim"] = config["text_config"]["head_dim"]
        (src / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    assert cli("draft", src, out, "--dialect", "per-layer").code == 0
    ours = json.loads((out / "config.json").read_text())["text_config"]
    assert ours["per_layer_config"] == _transformers_spelling(src, tmp_path)
    assert "global_head_dim" not in ours and "num_global_key_value_heads" not in ours
    # And back: the flat dialect restores the published file's values.
    flat = tmp_path / "flat"
    assert cli("draft", out, flat).code == 0
    restored = json.loads((flat / "config.json").read_text())["text_config"]
    original = json.loads((src / "config.json").read_text())["text_config"]
    assert restored["global_head_dim"] == original["global_head_dim"]
    assert restored["num_global_key_value_heads"] == original["num_global_key_value_heads"]
