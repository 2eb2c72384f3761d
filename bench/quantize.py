"""Benchmark `mtp-convert quantize` (fp8-dynamic and nvfp4a16) against a plain copy; measure its peak memory.

    python bench/quantize.py [--size-gb 2.2] [--workdir DIR] [--rounds 1] [--keep]

Uses the synthetic Gemma-like checkpoint of bench/reshard.py (BF16, a few 270-470 MB embedding-like
tensors, decoder Linear weights of 4-34 MB). Each round copies the files (the baseline, fsync'ed as
mtpkit fsyncs) and runs `python -m mtpkit quantize SRC OUT --scheme S` as a child process, measured by
the same wait4 method as bench/reshard.py. Prints throughput as a ratio to the copy (quantizing is
compute on the CPU, so expect well below 1) and peak RSS against the goal 2 x largest tensor + 500 MB.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reshard import copy_folder, run_child, run_in_workdir, synthetic_specs, write_source  # noqa: E402

RSS_SLACK = 500 * 10**6
SCHEMES = ("fp8-dynamic", "nvfp4a16")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gb", type=float, default=2.2)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--keep", action="store_true")
    run_in_workdir(bench, parser.parse_args(), "quantize")


def bench(work: Path, args: argparse.Namespace) -> None:
    specs = synthetic_specs(int(args.size_gb * 1e9))
    src = work / "src"
    start = time.perf_counter()
    write_source(src, specs)
    file_bytes = sum(p.stat().st_size for p in src.iterdir())
    largest = max(specs, key=lambda s: s.nbytes)
    print(f"source: {len(specs)} tensors, {file_bytes:,} bytes (written in {time.perf_counter() - start:.1f} s); "
          f"largest tensor {largest.name} = {largest.nbytes:,} bytes")
    logs = work / "logs"
    logs.mkdir()
    copies: list[float] = []
    results: dict[str, list[tuple[float, int]]] = {s: [] for s in SCHEMES}
    for r in range(args.rounds):
        copies.append(copy_folder(src, work / "copy"))
        shutil.rmtree(work / "copy")
        for scheme in SCHEMES:
            out = work / "out"
            results[scheme].append(run_child([sys.executable, "-m", "mtpkit", "quantize", str(src), str(out),
                                              "--scheme", scheme], logs / f"{scheme}-{r}.log"))
            shutil.rmtree(out)
        print(f"round {r + 1}: copy {copies[-1]:.2f} s, " + ", ".join(
            f"{s} {results[s][-1][0]:.2f} s (peak RSS {results[s][-1][1] / 1e6:.0f} MB)" for s in SCHEMES))
    copy_s = statistics.median(copies)
    goal = 2 * largest.nbytes + RSS_SLACK
    print(f"\ncopy: {file_bytes / 1e9 / copy_s:.3f} GB/s (median {copy_s:.2f} s)")
    for scheme in SCHEMES:
        wall = statistics.median(w for w, _ in results[scheme])
        peak = max(rss for _, rss in results[scheme])
        print(f"{scheme:12s} {file_bytes / 1e9 / wall:.3f} GB/s, ratio to copy {copy_s / wall:.2f}; peak RSS "
              f"{peak / 1e6:.0f} MB, goal 2 x largest + 500 MB = {goal / 1e6:.0f} MB  {'PASS' if peak <= goal else 'MISS'}")


if __name__ == "__main__":
    main()
