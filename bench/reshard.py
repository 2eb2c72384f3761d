"""Benchmark `mtp-convert reshard` against a plain file copy, and measure its peak memory.

    python bench/reshard.py [--size-gb 2.2] [--workdir DIR] [--rounds 3] [--keep]

Writes a synthetic bf16 checkpoint of at least --size-gb gigabytes (a few 270-470 MB embedding-like
tensors, many 4-34 MB layer tensors and small norms) in several shards plus an index, with mtpkit's own
streaming writer, one tensor produced at a time, so this script stays bounded in memory. Then, in
alternating rounds:

  (a) copy:    shutil.copyfile of every source file, each fsync'ed (mtpkit fsyncs its shards), then the folder;
  (b) reshard: `python -m mtpkit reshard SRC OUT --max-shard-size 1GB` as a child process, timed wall-clock
               from spawn to exit (interpreter start and imports included) and its peak RSS recorded.

Goals: reshard throughput >= 0.7 x copy throughput (medians over the rounds), and reshard peak RSS
<= 2 x the largest tensor + 300 MB. A child that only starts the CLI (`python -m mtpkit --help`) is
measured too: the interpreter + CLI imports floor that every command pays (torch is imported only where a command materialises tensors).

Both sides read the source from the page cache (it was just written and the machine has room for it)
and both write through the page cache and fsync, so they do the same I/O; the copy is the ceiling.
GB and MB are decimal (10^9, 10^6 bytes).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from mtpkit.convert.checkpoint import open_checkpoint
from mtpkit.convert.safetensors_file import load_tensor
from mtpkit.convert.writer import TensorSpec, write_checkpoint_tensors

RSS_GOAL_SLACK = 300 * 10**6
THROUGHPUT_GOAL = 0.7


# --- the synthetic checkpoint ---------------------------------------------------------------------------------

def synthetic_specs(size_bytes: int) -> list[TensorSpec]:
    """A Gemma-like layout: three large embedding tables, then decoder layers until `size_bytes` is reached."""
    specs = [
        TensorSpec("model.embed_tokens.weight", "BF16", (262144, 896)),             # 470 MB
        TensorSpec("model.embed_tokens_per_layer.weight", "BF16", (262144, 640)),   # 336 MB
        TensorSpec("model.embed_vision.embedding.weight", "BF16", (131072, 1024)),  # 268 MB
        TensorSpec("model.norm.weight", "BF16", (2048,)),
    ]
    hidden, inter, q_dim, kv_dim = 2048, 8192, 4096, 1024
    layer_shapes = {
        "self_attn.q_proj.weight": (q_dim, hidden),      # 16.8 MB
        "self_attn.k_proj.weight": (kv_dim, hidden),     # 4.2 MB
        "self_attn.v_proj.weight": (kv_dim, hidden),     # 4.2 MB
        "self_attn.o_proj.weight": (hidden, q_dim),      # 16.8 MB
        "mlp.gate_proj.weight": (inter, hidden),         # 33.6 MB
        "mlp.up_proj.weight": (inter, hidden),           # 33.6 MB
        "mlp.down_proj.weight": (hidden, inter),         # 33.6 MB
        "input_layernorm.weight": (hidden,),
        "post_attention_layernorm.weight": (hidden,),
        "self_attn.q_norm.weight": (256,),
        "self_attn.k_norm.weight": (256,),
    }
    layer = 0
    while sum(s.nbytes for s in specs) < size_bytes:
        specs += [TensorSpec(f"model.layers.{layer}.{name}", "BF16", shape) for name, shape in layer_shapes.items()]
        layer += 1
    return specs


def write_source(folder: Path, specs: list[TensorSpec]) -> None:
    generator = torch.Generator().manual_seed(0)

    def produce(spec: TensorSpec) -> torch.Tensor:
        # Random-ish bf16 values (not zeros: a filesystem could store those sparsely).
        return torch.randn(spec.shape, generator=generator, dtype=torch.bfloat16)

    folder.mkdir()
    # 700MB shards: several source files, laid out differently from the 1GB output.
    write_checkpoint_tensors(folder, specs, produce, max_shard_size="700MB")
    layers = 1 + max(int(s.name.split(".")[2]) for s in specs if s.name.startswith("model.layers."))
    # A Gemma 4 text config that matches the tensors (mtpkit validates configs before writing).
    config = {"architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text", "num_hidden_layers": layers,
              "hidden_size": 2048, "intermediate_size": 8192, "num_attention_heads": 16, "num_key_value_heads": 4,
              "head_dim": 256, "vocab_size": 262144}
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")


# --- measurements -------------------------------------------------------------------------------------------------

def copy_folder(src: Path, dst: Path) -> float:
    """The baseline: copy every file and fsync it (then the folder), as mtpkit does with its output."""
    start = time.perf_counter()
    dst.mkdir()
    for path in sorted(src.iterdir()):
        target = dst / path.name
        shutil.copyfile(path, target)  # on Linux: sendfile in the kernel, as mtpkit copies tensor bytes
        fd = os.open(target, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    fd = os.open(dst, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - start


# Runs in a fresh, small interpreter: spawns the measured command, reaps it with wait4 and reports.
_MEASURE = r"""
import json, os, subprocess, sys, time
argv, log = json.loads(sys.argv[1]), sys.argv[2]
# This process's own peak so far (VmHWM belongs to the address space, which exec replaced; its
# ru_maxrss would instead still carry the bench script's peak, inherited the same way).
with open("/proc/self/status") as f:
    floor_kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
with open(log, "wb") as out:
    start = time.perf_counter()
    child = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - start
print(json.dumps({"wall": wall, "maxrss_kib": usage.ru_maxrss, "code": os.waitstatus_to_exitcode(status),
                  "floor_kib": floor_kib}))
"""


# The path every transforming command (quantize, draft) takes: each tensor is mapped, passed through
# torch (cloned, as a transform would allocate its result) and written by the streaming writer.
_STREAM_TENSORS = r"""
import sys
from pathlib import Path
from mtpkit.convert.checkpoint import open_checkpoint
from mtpkit.convert.safetensors_file import load_tensor
from mtpkit.convert.writer import TensorSpec, write_checkpoint_tensors
checkpoint, out = open_checkpoint(Path(sys.argv[1])), Path(sys.argv[2])
out.mkdir()
specs = [TensorSpec.of(info) for info in checkpoint.tensors.values()]
write_checkpoint_tensors(out, specs, lambda spec: load_tensor(checkpoint.tensors[spec.name]).clone(),
                         max_shard_size="1GB")
(out / "config.json").write_bytes((checkpoint.folder / "config.json").read_bytes())
"""


def run_child(argv: list[str], log: Path) -> tuple[float, int]:
    """Run `argv`; return (wall seconds from spawn to exit, peak RSS in bytes of that process alone).

    How the peak is measured, and why through an intermediate process:
    - getrusage(RUSAGE_CHILDREN).ru_maxrss is the maximum over *every* child ever waited for, so one
      large child masks every later, smaller one. os.wait4(pid) instead returns the rusage of exactly
      the child it reaps.
    - But a child's ru_maxrss also includes the high-water RSS of the memory image it replaced at exec:
      the kernel folds the old mm's hiwater into the process's maxrss in exec. A child forked or vforked
      from this script starts as (or borrowing) this script's address space, which holds torch and once
      held the largest synthetic tensor, so its ru_maxrss would report this script's peak, not its own
      (seen in practice: a `--help` child "peaking" at 1.2 GB).
    - So the command is spawned by a fresh, small Python (_MEASURE, no torch, ~10 MB) that reaps it with
      wait4: what the command inherits at exec is only that small image (its VmHWM, checked below: the
      figure's lower bound). Exact, unlike polling /proc/<pid>/status VmHWM, which vanishes at
      exit and can miss a late peak. Linux reports ru_maxrss in KiB.
    """
    raw = subprocess.run([sys.executable, "-c", _MEASURE, json.dumps(argv), str(log)],
                         stdin=subprocess.DEVNULL, capture_output=True, text=True, check=True).stdout
    result = json.loads(raw)
    if result["code"] != 0:
        sys.exit(f"bench: {' '.join(argv)} failed with exit {result['code']}:\n{log.read_text()[-4000:]}")
    if result["floor_kib"] * 1024 > 100 * 10**6:
        print(f"warning: the measuring process itself peaked at {result['floor_kib'] / 1024:.0f} MiB; "
              "RSS figures include it")
    return result["wall"], result["maxrss_kib"] * 1024


def check_output(src: Path, out: Path, sample: int = 4) -> None:
    """The re-sharded checkpoint holds the same tensors; a few (the largest among them) have equal values."""
    a, b = open_checkpoint(src), open_checkpoint(out)
    assert {n: (t.dtype, t.shape) for n, t in a.tensors.items()} == {n: (t.dtype, t.shape) for n, t in b.tensors.items()}
    assert len(b.shards) > 1 and a.total_bytes == b.total_bytes
    names = sorted(a.tensors, key=lambda n: -a.tensors[n].nbytes)[:2] + sorted(a.tensors)[:: max(1, len(a.tensors) // sample)]
    for name in names:
        assert torch.equal(load_tensor(a.tensors[name]), load_tensor(b.tensors[name])), name


# --- main ------------------------------------------------------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gb", type=float, default=2.2, help="at least this many GB of tensors (default 2.2)")
    parser.add_argument("--workdir", type=Path, default=None, help="parent folder for the work folder (default /tmp)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating copy/reshard rounds (default 3)")
    parser.add_argument("--keep", action="store_true", help="keep the work folder")
    run_in_workdir(bench, parser.parse_args(), "reshard")


def run_in_workdir(bench_fn, args: argparse.Namespace, name: str) -> None:
    """Run `bench_fn(work, args)` in a fresh work folder under --workdir (default /tmp), removed unless --keep."""
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f"mtpkit-bench-{name}-", dir=args.workdir or "/tmp"))
    try:
        bench_fn(work, args)
    finally:
        if args.keep:
            print(f"work folder kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


def bench(work: Path, args: argparse.Namespace) -> None:
    specs = synthetic_specs(int(args.size_gb * 1e9))
    src = work / "src"
    start = time.perf_counter()
    write_source(src, specs)
    write_s = time.perf_counter() - start
    total_tensor_bytes = sum(s.nbytes for s in specs)
    largest = max(specs, key=lambda s: s.nbytes)
    file_bytes = sum(p.stat().st_size for p in src.iterdir())
    shards = sorted(p.name for p in src.glob("*.safetensors"))
    print(f"source: {len(specs)} tensors, {total_tensor_bytes:,} tensor bytes, {file_bytes:,} file bytes "
          f"in {len(shards)} shards (written in {write_s:.1f} s)")
    print(f"largest tensor: {largest.name} {list(largest.shape)} = {largest.nbytes:,} bytes")

    logs = work / "logs"
    logs.mkdir()
    py = sys.executable
    copy_s, reshard_s, reshard_rss, startup_s, startup_rss, stream_s, stream_rss = [], [], [], [], [], [], []
    for r in range(args.rounds):
        dst = work / "copy"
        copy_s.append(copy_folder(src, dst))
        shutil.rmtree(dst)

        out = work / "out"
        wall, rss = run_child([py, "-m", "mtpkit", "reshard", str(src), str(out), "--max-shard-size", "1GB"],
                              logs / f"reshard-{r}.log")
        reshard_s.append(wall)
        reshard_rss.append(rss)
        if r == 0:
            check_output(src, out)
        shutil.rmtree(out)

        wall, rss = run_child([py, "-c", _STREAM_TENSORS, str(src), str(out)], logs / f"stream-{r}.log")
        stream_s.append(wall)
        stream_rss.append(rss)
        if r == 0:
            check_output(src, out)
        shutil.rmtree(out)

        wall, rss = run_child([py, "-m", "mtpkit", "--help"], logs / f"startup-{r}.log")
        startup_s.append(wall)
        startup_rss.append(rss)
        print(f"round {r + 1}: copy {copy_s[-1]:.2f} s, reshard {reshard_s[-1]:.2f} s "
              f"(peak RSS {reshard_rss[-1] / 1e6:.0f} MB), tensors through torch {stream_s[-1]:.2f} s "
              f"(peak RSS {stream_rss[-1] / 1e6:.0f} MB), CLI start only {startup_s[-1]:.2f} s "
              f"(peak RSS {startup_rss[-1] / 1e6:.0f} MB)")

    gb = file_bytes / 1e9
    copy_gbps = gb / statistics.median(copy_s)
    reshard_gbps = gb / statistics.median(reshard_s)
    ratio = reshard_gbps / copy_gbps
    peak = max(reshard_rss)
    rss_goal = 2 * largest.nbytes + RSS_GOAL_SLACK
    start_med = statistics.median(startup_s)
    net_gbps = gb / max(statistics.median(reshard_s) - start_med, 1e-9)

    print()
    print(f"total bytes:               {file_bytes:,} ({gb:.3f} GB in files; {total_tensor_bytes:,} tensor bytes)")
    print(f"largest tensor bytes:      {largest.nbytes:,} ({largest.nbytes / 1e6:.1f} MB)")
    print(f"copy throughput:           {copy_gbps:.3f} GB/s (median of {args.rounds}: {statistics.median(copy_s):.2f} s)")
    print(f"reshard throughput:        {reshard_gbps:.3f} GB/s (median of {args.rounds}: "
          f"{statistics.median(reshard_s):.2f} s wall, process start included)")
    print(f"  without CLI start:       {net_gbps:.3f} GB/s (median start-only child: {start_med:.2f} s)")
    print(f"ratio reshard/copy:        {ratio:.2f}  goal >= {THROUGHPUT_GOAL}  "
          f"{'PASS' if ratio >= THROUGHPUT_GOAL else 'MISS'}")
    print(f"reshard peak RSS:          {peak / 1e6:.0f} MB (max of {args.rounds}: "
          f"{', '.join(f'{x / 1e6:.0f}' for x in reshard_rss)} MB)")
    print(f"CLI start-only peak RSS:   {max(startup_rss) / 1e6:.0f} MB (interpreter + CLI imports)")
    print(f"RSS goal 2 x largest + 300 MB: {rss_goal / 1e6:.0f} MB  {'PASS' if peak <= rss_goal else 'MISS'}")
    stream_peak = max(stream_rss)
    print(f"tensors through torch:     {gb / statistics.median(stream_s):.3f} GB/s, ratio to copy "
          f"{statistics.median(copy_s) / statistics.median(stream_s):.2f}; peak RSS {stream_peak / 1e6:.0f} MB "
          f"(goal {rss_goal / 1e6:.0f} MB  {'PASS' if stream_peak <= rss_goal else 'MISS'}; torch import included)")


if __name__ == "__main__":
    main()
