"""Security: nothing unpickled, no remote code, the Hub token never leaks; and config rewriting never fails with
anything but a typed error, whatever the config (hypothesis)."""

from __future__ import annotations

import ast
import json
import subprocess
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mtpkit
from mtpkit.convert.checkpoint import open_checkpoint
from mtpkit.convert.draft_rules import canonical_config
from mtpkit.errors import MtpkitError
from tests.cli.test_entry_points import ENTRY_POINTS, _env

PACKAGE = Path(mtpkit.__file__).parent
SENTINEL = "hf_SENTINELtokenDoNotLeak0123456789"


def test_the_package_never_unpickles_or_runs_remote_code():
    """An AST scan of every module: no pickle / torch.load / trust_remote_code=True anywhere in mtpkit."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) else [])
                if any(n and n.split(".")[0] in ("pickle", "dill", "joblib") for n in names):
                    found.append(f"{path}: imports pickle")
            if isinstance(node, ast.Attribute) and node.attr == "load" and getattr(node.value, "id", "") == "torch":
                found.append(f"{path}:{node.lineno}: torch.load")
            if isinstance(node, ast.keyword) and node.arg == "trust_remote_code":
                if not (isinstance(node.value, ast.Constant) and node.value.value is False):
                    found.append(f"{path}:{node.lineno}: trust_remote_code not literally False")
    assert found == []


def test_a_sentinel_token_never_appears(tiny, tmp_path):
    """HF_TOKEN set, tracebacks on (MTPKIT_DEBUG=1), through successes and failures, including a Hub fetch that
    fails offline: the token is in no output and no written file."""
    calib = tmp_path / "calib.jsonl"
    calib.write_text(json.dumps({"input_ids": list(range(3, 30))}) + "\n")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"input_ids": [5, 6, 7]}) + "\n")
    target, draft = tiny("e2b_like"), tiny("assistant_centroids")
    runs = [
        ["inspect", str(target)],
        ["inspect", "some-owner/some-gated-repo"],  # offline: fails, naming the repo
        ["draft", str(draft), str(tmp_path / "d")],
        ["quantize", str(target), str(tmp_path / "q"), "--scheme", "fp8", "--calib", str(calib)],
        ["pair", str(tmp_path / "p"), "--target", str(tmp_path / "q"), "--draft", str(tmp_path / "d")],
        ["check", str(tmp_path / "p")],
        ["run", str(tmp_path / "p"), "--prompt-file", str(prompts), "--max-new-tokens", "4", "--json"],
        ["run", "owner/missing-pair", "--prompt", "x"],
    ]
    env = {**_env(), "HF_TOKEN": SENTINEL, "MTPKIT_DEBUG": "1", "HF_HOME": str(tmp_path / "hf")}
    for argv in runs:
        result = subprocess.run([*ENTRY_POINTS["module"], *argv], capture_output=True, text=True, env=env,
                                timeout=120)
        assert SENTINEL not in result.stdout and SENTINEL not in result.stderr, argv
    for path in tmp_path.rglob("*"):
        if path.is_file():
            assert SENTINEL.encode() not in path.read_bytes(), path


_JSON = st.recursive(st.none() | st.booleans() | st.integers(-3, 10**6) | st.floats(allow_nan=False) | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                     max_leaves=12)
_KEYS = ["model_type", "text_config", "hidden_size", "num_hidden_layers", "layer_types", "head_dim", "global_head_dim",
         "num_key_value_heads", "num_attention_heads", "backbone_hidden_size", "vocab_size", "num_kv_shared_layers",
         "use_ordered_embeddings", "num_centroids", "quantization_config", "per_layer_config", "sliding_window",
         "rope_parameters", "tie_word_embeddings", "architectures"]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edits=st.lists(st.tuples(st.booleans(), st.sampled_from(_KEYS), _JSON), min_size=1, max_size=4))
def test_config_rewriting_fails_only_with_typed_errors(tiny, edits):
    """Random damage to a real assistant config (top level or text_config): canonical_config either rewrites it
    or raises an MtpkitError; never a KeyError, TypeError, ... (a crash)."""
    checkpoint = open_checkpoint(tiny("assistant_centroids"))
    config = json.loads(json.dumps(checkpoint.config))
    for nested, key, value in edits:
        holder = config.get("text_config") if nested and isinstance(config.get("text_config"), dict) else config
        holder[key] = value
    try:
        canonical_config(config, checkpoint.tensors)
    except MtpkitError:
        pass

