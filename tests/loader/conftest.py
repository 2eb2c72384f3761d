"""Fixtures shared by the loader tests."""

from __future__ import annotations

import shutil

import pytest
import torch

from tests.fixtures.tokenizer import copy_tokenizer, write_tokenizer


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Toy matrices: one intra-op thread is faster, and immune to a busy machine's thread contention."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tokenized_pair(tiny, tmp_path_factory):
    """e2b_like + assistant_centroids with the same tokenizer, and the `mtp-convert pair` folder made of them."""
    from mtpkit.cli.app import main

    root = tmp_path_factory.mktemp("pair")
    target, draft = root / "target-src", root / "draft-src"
    shutil.copytree(tiny("e2b_like"), target)
    shutil.copytree(tiny("assistant_centroids"), draft)
    write_tokenizer(target)
    copy_tokenizer(target, draft)
    try:
        main(["pair", str(root / "pair"), "--target", str(target), "--draft", str(draft)])
    except SystemExit as e:
        assert e.code in (0, None)
    return {"target": target, "draft": draft, "pair": root / "pair"}
