"""load_pair from Hub repo ids, resolved offline from a pre-populated Hugging Face Hub cache.

The cache is laid out as huggingface_hub writes it (tests/convert/test_source.py builds it and checks the
layout against huggingface_hub's own scanner): snapshots/<commit>/<file> are relative links into blobs/.
Oracle: the same pair loaded from the local folder the cache was filled from gives the same tokens.
"""

from __future__ import annotations


import pytest

from mtpkit.errors import SourceNotFoundError
from mtpkit.loader import load_pair
from tests.convert import test_source as source_tests

no_network = source_tests.no_network  # fixture: any network attempt fails the test
PAIR_REPO, TARGET_REPO, DRAFT_REPO = "acme/tiny-pair", "acme/tiny-target", "acme/tiny-assistant"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
PROMPTS = [[5, 17, 33, 2, 99, 64, 7, 8, 120, 3, 44, 45, 9], [7, 8, 9, 10, 11]]


@pytest.fixture(scope="module")
def local(tokenized_pair):
    return tokenized_pair


@pytest.fixture
def hub(tmp_path, monkeypatch, local, no_network):
    cache = tmp_path / "hub-cache"
    cache.mkdir()
    snapshots = {repo: source_tests.add_commit(cache, repo, COMMIT, source_tests.folder_files(local[key]), ref="main")
                 for repo, key in ((PAIR_REPO, "pair"), (TARGET_REPO, "target"), (DRAFT_REPO, "draft"))}
    source_tests.use_offline_cache(monkeypatch, cache, tmp_path)
    return snapshots


def _outputs(pair):
    greedy = pair.generate(PROMPTS, max_new_tokens=12, num_speculative_tokens=3)
    sampled = pair.generate(PROMPTS, max_new_tokens=12, num_speculative_tokens=2, temperature=0.8, seed=3)
    text = pair.generate("hello world", max_new_tokens=8, num_speculative_tokens=2)[0]
    return [g.token_ids for g in greedy + sampled] + [text.token_ids, text.text]


def test_a_pair_repo_resolves_to_the_same_pair_as_the_local_folder(hub, local):
    from_hub = load_pair(PAIR_REPO, dtype="float32", device="cpu")
    assert from_hub.target.checkpoint.folder == hub[PAIR_REPO] / "target"
    assert from_hub.draft.checkpoint.folder == hub[PAIR_REPO] / "draft"
    assert from_hub.tokenizer is not None
    expected = _outputs(load_pair(local["pair"], dtype="float32", device="cpu"))
    assert _outputs(from_hub) == expected
    # The commit hash and local_files_only name the same snapshot.
    pinned = load_pair(PAIR_REPO, revision=COMMIT, local_files_only=True, dtype="float32", device="cpu")
    assert pinned.target.checkpoint.folder == hub[PAIR_REPO] / "target"
    assert _outputs(pinned) == expected


def test_target_and_draft_repos(hub, local):
    pair = load_pair(target=TARGET_REPO, draft=DRAFT_REPO, dtype="float32", device="cpu")
    assert pair.target.checkpoint.folder == hub[TARGET_REPO]
    assert pair.target.checkpoint.origin["repo_id"] == TARGET_REPO
    assert _outputs(pair) == _outputs(load_pair(target=local["target"], draft=local["draft"], dtype="float32",
                                                device="cpu"))


def test_a_repo_missing_from_the_cache_is_a_clear_error(hub):
    with pytest.raises(SourceNotFoundError, match="HF_HUB_OFFLINE"):
        load_pair("acme/not-cached", dtype="float32", device="cpu")
    with pytest.raises(SourceNotFoundError, match="no-such-branch"):
        load_pair(PAIR_REPO, revision="no-such-branch", dtype="float32", device="cpu")
