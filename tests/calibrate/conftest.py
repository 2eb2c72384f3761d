"""Calibration inputs for the tests: random token ids written as a `--calib` JSONL file."""

from __future__ import annotations

import json

import pytest
import torch


@pytest.fixture
def calib_file(tmp_path):
    """calib_file(lengths, seed) -> (path of a JSONL of input_ids, the sequences as tensors)."""

    def make(lengths: tuple[int, ...], seed: int) -> tuple:
        g = torch.Generator().manual_seed(seed)
        sequences = [torch.randint(3, 120, (n,), generator=g) for n in lengths]  # no pad / bos / eos / media ids
        path = tmp_path / f"calib-{seed}.jsonl"
        path.write_text("".join(json.dumps({"input_ids": s.tolist()}) + "\n" for s in sequences))
        return path, sequences

    return make
