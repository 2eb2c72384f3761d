"""`mtp-convert bench`: every k reproduces target-only greedy tokens, transformers' assisted generation gives
the same tokens (the oracle), and the plot is a PNG."""

from __future__ import annotations

import json

import pytest

from mtpkit.cli.bench_cmd import parse_ks
from mtpkit.errors import ConfigError


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in ([5, 6, 7, 8, 9], [12, 13, 14, 15])))
    return path


def test_sweep_json_plot_and_transformers_baseline(tiny, cli, tmp_path, prompts):
    png = tmp_path / "bench.png"
    result = cli("bench", "--target", tiny("e2b_like"), "--draft", tiny("assistant_centroids"), "--prompts", prompts,
                 "--k", "1..3", "--max-new-tokens", "10", "--dtype", "float32", "--plot", png,
                 "--baseline", "transformers", "--json")
    assert result.code == 0, result.err
    report = json.loads(result.out)
    rows = report["results"]
    assert [r["k"] for r in rows] == [0, 1, 2, 3] and all(r["matches_target_only"] for r in rows)
    assert [len(r["acceptance_per_position"]) for r in rows] == [0, 1, 2, 3]
    assert report["recommended_k"] == max(rows[1:], key=lambda r: r["speedup"])["k"]
    assert rows[0]["speedup"] == 1.0 and rows[0]["tokens"] == 20
    # transformers' own assisted generation, same pair and prompts: the same tokens.
    assert report["transformers"]["tokens_match"] is True and report["transformers"]["k"] == report["recommended_k"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_table(tiny, cli, prompts):
    result = cli("bench", "--target", tiny("e2b_like"), "--draft", tiny("assistant_centroids"), "--prompts", prompts,
                 "--k", "2", "--max-new-tokens", "6")
    assert result.code == 0, result.err
    assert "recommended k: 2" in result.out and "(target only)" in result.out


def test_k_values():
    assert parse_ks("1..8") == list(range(1, 9)) and parse_ks("1-3") == [1, 2, 3] and parse_ks("4,1,2") == [1, 2, 4]
    for bad in ("0..3", "a", "1..17", ""):
        with pytest.raises(ConfigError):
            parse_ks(bad)


def test_missing_prompts_name_benchs_own_options(tiny, cli, tmp_path):
    pair = ("--target", tiny("e2b_like"), "--draft", tiny("assistant_centroids"))
    result = cli("bench", *pair)
    assert result.code == 2 and "bench: no prompt given" in result.err and "--prompts FILE" in result.err, result.err
    result = cli("bench", *pair, "--prompts", tmp_path / "absent.txt")
    assert result.code == 2 and "give --prompts a text or JSONL file" in result.err, result.err
    assert result.err.count("\n") == 1  # one line
