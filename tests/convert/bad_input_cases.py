"""The bad-input corpus: each case damages a private copy of a tiny checkpoint in one way.

`tests/convert/test_bad_input.py` runs every case through the commands and checks the contract.
"""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import safetensors
import torch
from safetensors.torch import save_file

from mtpkit.convert.checkpoint import INDEX_FILE, open_checkpoint
from mtpkit.convert.reshard import reshard

SHARDED_SIZE = "100KB"  # e2b_like (~405 KB of tensors) -> 5 shards


def reference_reads(path: Path) -> dict[str, torch.Tensor]:
    """The reference safetensors library's reading of `path` (proves a damaged copy still holds what we claim)."""
    with safetensors.safe_open(str(path), "pt") as f:
        return {key: f.get_tensor(key) for key in f.keys()}


# ----------------------------------------------------------------------------------------------- helpers


@dataclass
class Env:
    tmp: Path
    tiny_copy: Callable[[str], Path]

    def sharded(self) -> Path:
        """e2b_like re-sharded into several shards with an index (a private folder a case may damage)."""
        dest = self.tmp / "sharded"
        reshard(open_checkpoint(self.tiny_copy("e2b_like")), dest, max_shard_size=SHARDED_SIZE)
        assert (dest / INDEX_FILE).is_file() and len(list(dest.glob("*.safetensors"))) > 2
        return dest


@dataclass
class Setup:
    src: Path  # what is passed as SRC
    names: list[Path | str]  # a Path must appear as a whole path in the error line; a str as a substring
    out: Path | None = None  # OUT for reshard (default: tmp/"out")
    args: tuple[str, ...] = ()  # extra reshard arguments
    corrupt: Path | None = None  # a safetensors file the reference library must reject
    out_preexists: bool = False
    absent: tuple[str, ...] = ()  # substrings the error line must NOT contain (it would name the wrong file)


@dataclass
class Case:
    id: str
    make: Callable[[Env], Setup]
    commands: tuple[str, ...] = ("inspect", "reshard")


def _config(folder: Path) -> Path:
    return folder / "config.json"


def _edit_config(folder: Path, edit: Callable[[dict], None]) -> Path:
    path = _config(folder)
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data, indent=2))
    return path


def _read_raw_header(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _write_raw(path: Path, header: bytes, data: bytes) -> None:
    header += b" " * (-(8 + len(header)) % 8)
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)


def _rewrite_header(path: Path, edit: Callable[[dict], None]) -> Path:
    """Change the JSON header of a safetensors file, keeping its data bytes as they are."""
    header, data = _read_raw_header(path)
    edit(header)
    _write_raw(path, json.dumps(header, separators=(",", ":")).encode(), data)
    return path


def _tensor_entries(header: dict) -> list[tuple[str, dict]]:
    return sorted(((k, v) for k, v in header.items() if k != "__metadata__"), key=lambda kv: kv[1]["data_offsets"])


def _index(folder: Path) -> dict:
    return json.loads((folder / INDEX_FILE).read_text())


def _write_index(folder: Path, index: dict) -> Path:
    path = folder / INDEX_FILE
    path.write_text(json.dumps(index, indent=2))
    return path


def _shard_names(folder: Path) -> list[str]:
    return sorted(set(_index(folder)["weight_map"].values()))


# ------------------------------------------------------------------------------------------------- cases
# Folder and config.json


def missing_folder(env: Env) -> Setup:
    src = env.tmp / "no-such-checkpoint"
    return Setup(src, [src])


def file_not_folder(env: Env) -> Setup:
    src = env.tiny_copy("text_only") / "model.safetensors"
    return Setup(src, [src])


def no_config(env: Env) -> Setup:
    src = env.tiny_copy("text_only")
    _config(src).unlink()
    return Setup(src, [src, "config.json"])


def config_is_a_folder(env: Env) -> Setup:
    src = env.tiny_copy("text_only")
    _config(src).unlink()
    _config(src).mkdir()
    (_config(src) / "keep").write_text("x")  # so tree_digest sees the folder
    return Setup(src, [_config(src)])


def config_invalid_json(env: Env) -> Setup:
    src = env.tiny_copy("text_only")
    text = _config(src).read_text()
    _config(src).write_text(text[: len(text) // 2])  # cut in the middle of an object
    return Setup(src, [_config(src)])


def config_not_utf8(env: Env) -> Setup:
    src = env.tiny_copy("text_only")
    _config(src).write_bytes(_config(src).read_bytes().replace(b'"gemma4_text"', b'"gemma4_text\xff\xfe"'))
    return Setup(src, [_config(src)])


def config_json_list(env: Env) -> Setup:
    src = env.tiny_copy("text_only")
    _config(src).write_text(json.dumps([json.loads(_config(src).read_text())]))
    return Setup(src, [_config(src)])


def config_duplicate_keys(env: Env) -> Setup:
    src = env.tiny_copy("text_only")
    text = _config(src).read_text()
    assert text.lstrip().startswith("{")
    # A second model_type: json.loads would silently keep the last one.
    _config(src).write_text(text.replace("{", '{\n  "model_type": "llama",', 1))
    return Setup(src, [_config(src), "model_type"])


def config_deeply_nested(env: Env) -> Setup:
    src = env.tiny_copy("text_only")
    depth = 100_000
    _config(src).write_text('{"model_type": "gemma4_text", "x": ' + "[" * depth + "]" * depth + "}")
    return Setup(src, [_config(src)])


def unknown_model_type(env: Env) -> Setup:
    src = env.tiny_copy("text_only")
    path = _edit_config(src, lambda c: c.update(model_type="llama"))
    return Setup(src, [path, "llama"])


def text_config_not_object(env: Env) -> Setup:
    src = env.tiny_copy("e2b_like")
    path = _edit_config(src, lambda c: c.update(text_config=["not", "an", "object"]))
    return Setup(src, [path, "text_config"])


def num_hidden_layers_string(env: Env) -> Setup:
    src = env.tiny_copy("text_only")
    path = _edit_config(src, lambda c: c.update(num_hidden_layers=str(c["num_hidden_layers"])))
    return Setup(src, [path, "num_hidden_layers"])


def layer_types_length_mismatch(env: Env) -> Setup:
    src = env.tiny_copy("e2b_like")
    path = _edit_config(src, lambda c: c.update(layer_types=c["layer_types"][:-1]))
    return Setup(src, [path, "layer_types"])


# Index and shards


def index_missing_shard(env: Env) -> Setup:
    src = env.sharded()
    victim = _shard_names(src)[1]
    (src / victim).unlink()
    return Setup(src, [src / INDEX_FILE, victim])


def index_shard_dotdot(env: Env) -> Setup:
    src = env.sharded()
    victim = _shard_names(src)[0]
    shutil.move(src / victim, env.tmp / victim)  # "../victim" really exists, outside the folder
    index = _index(src)
    index["weight_map"] = {k: (f"../{v}" if v == victim else v) for k, v in index["weight_map"].items()}
    return Setup(src, [_write_index(src, index), f"../{victim}"])


def index_shard_symlink_outside(env: Env) -> Setup:
    src = env.sharded()
    victim = _shard_names(src)[0]
    outside = env.tmp / "elsewhere.safetensors"
    shutil.move(src / victim, outside)
    (src / victim).symlink_to(outside)
    return Setup(src, [src / victim])  # the offending file is the link


def tokenizer_symlink_outside(env: Env) -> Setup:
    src = env.tiny_copy("text_only")
    outside = env.tmp / "secret.json"
    outside.write_text('{"not": "part of the checkpoint"}')
    (src / "tokenizer.json").symlink_to(outside)
    return Setup(src, [src / "tokenizer.json"])


def index_lists_absent_tensor(env: Env) -> Setup:
    src = env.sharded()
    index = _index(src)
    index["weight_map"]["model.layers.99.ghost.weight"] = _shard_names(src)[0]
    return Setup(src, [_write_index(src, index), "model.layers.99.ghost.weight"])


def index_without_weight_map(env: Env) -> Setup:
    src = env.sharded()
    return Setup(src, [_write_index(src, {"metadata": _index(src)["metadata"]}), "weight_map"])


def index_invalid_json(env: Env) -> Setup:
    src = env.sharded()
    path = src / INDEX_FILE
    path.write_text(path.read_text()[:-20])
    return Setup(src, [path])


def duplicate_tensor_via_index(env: Env) -> Setup:
    src = env.sharded()
    first = _shard_names(src)[0]
    name, tensor = next(iter(reference_reads(src / first).items()))
    save_file({name: torch.zeros_like(tensor)}, str(src / "extra.safetensors"))
    index = _index(src)
    index["weight_map"][name] = "extra.safetensors"
    _write_index(src, index)
    # Oracle: both files are valid safetensors and both really hold `name`.
    assert name in reference_reads(src / "extra.safetensors") and name in reference_reads(src / first)
    return Setup(src, [src, "extra.safetensors", first, name])


def duplicate_tensor_no_index(env: Env) -> Setup:
    src = env.tiny_copy("text_only")
    (src / "model.safetensors").rename(src / "model-a.safetensors")
    name, tensor = next(iter(reference_reads(src / "model-a.safetensors").items()))
    save_file({name: torch.zeros_like(tensor)}, str(src / "model-b.safetensors"))
    assert name in reference_reads(src / "model-b.safetensors")
    return Setup(src, [src, "model-a.safetensors", "model-b.safetensors", name])


# Corrupt safetensors files (the reference library must reject each)


def _corrupt(env: Env, damage: Callable[[Path], None], base: str = "text_only") -> Setup:
    src = env.tiny_copy(base)
    path = src / "model.safetensors"
    damage(path)
    return Setup(src, [path], corrupt=path)


def truncated(env: Env) -> Setup:
    return _corrupt(env, lambda p: p.write_bytes(p.read_bytes()[:-100]))


def truncated_inside_header(env: Env) -> Setup:
    return _corrupt(env, lambda p: p.write_bytes(p.read_bytes()[:200]), base="e2b_like")


def header_length_past_end(env: Env) -> Setup:
    def damage(p: Path) -> None:
        raw = p.read_bytes()
        p.write_bytes(struct.pack("<Q", len(raw)) + raw[8:])

    return _corrupt(env, damage)


def header_not_json(env: Env) -> Setup:
    def damage(p: Path) -> None:
        raw = p.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        p.write_bytes(raw[:8] + b"this is not JSON".ljust(n, b" ") + raw[8 + n :])

    return _corrupt(env, damage)


def header_deeply_nested(env: Env) -> Setup:
    def damage(p: Path) -> None:
        depth = 100_000
        _write_raw(p, b'{"a":' + b"[" * depth + b"]" * depth + b"}", b"")

    return _corrupt(env, damage)


def header_is_a_list(env: Env) -> Setup:
    return _corrupt(env, lambda p: _write_raw(p, b"[]", b""))


def unknown_dtype(env: Env) -> Setup:
    def edit(header: dict) -> None:
        _, entry = _tensor_entries(header)[0]
        entry["dtype"] = "Q4_K"  # a GGUF type name, not a safetensors dtype

    setup = _corrupt(env, lambda p: _rewrite_header(p, edit))
    setup.names.append("Q4_K")
    return setup


def shape_bytes_mismatch(env: Env) -> Setup:
    victim = []

    def edit(header: dict) -> None:
        name, entry = _tensor_entries(header)[-1]
        entry["shape"] = [d + 1 for d in entry["shape"]]  # offsets unchanged: too few bytes for the shape
        victim.append(name)

    setup = _corrupt(env, lambda p: _rewrite_header(p, edit))
    setup.names.append(victim[0])
    return setup


def overlapping_offsets(env: Env) -> Setup:
    victim = []

    def edit(header: dict) -> None:
        entries = _tensor_entries(header)
        # Two tensors of the same byte size: give the later one the earlier one's bytes.
        by_size: dict[int, tuple[str, dict]] = {}
        for name, entry in entries:
            begin, end = entry["data_offsets"]
            if end - begin in by_size and end > begin:
                entry["data_offsets"] = list(by_size[end - begin][1]["data_offsets"])
                victim.append(name)
                return
            by_size.setdefault(end - begin, (name, entry))
        raise AssertionError("fixture has no two tensors of equal size")

    setup = _corrupt(env, lambda p: _rewrite_header(p, edit))
    setup.names.append(victim[0])
    return setup


def empty_file(env: Env) -> Setup:
    return _corrupt(env, lambda p: p.write_bytes(b""))


def pickle_named_safetensors(env: Env) -> Setup:
    return _corrupt(env, lambda p: torch.save({"w": torch.arange(16, dtype=torch.float32)}, p))


def safetensors_is_a_folder(env: Env) -> Setup:
    # No index, and model.safetensors is a folder: the line must name it, not a non-existent index.
    src = env.tiny_copy("text_only")
    path = src / "model.safetensors"
    path.unlink()
    path.mkdir()
    (path / "keep").write_text("x")
    return Setup(src, [path], absent=(INDEX_FILE,))


def safetensors_dangling_symlink(env: Env) -> Setup:
    src = env.tiny_copy("text_only")
    path = src / "model.safetensors"
    path.unlink()
    path.symlink_to(src / "model-gone.safetensors")  # inside the folder, but missing
    return Setup(src, [path], absent=(INDEX_FILE,))


def only_pytorch_model_bin(env: Env) -> Setup:
    src = env.tiny_copy("text_only")
    tensors = reference_reads(src / "model.safetensors")
    (src / "model.safetensors").unlink()
    torch.save(tensors, src / "pytorch_model.bin")
    return Setup(src, [src, "pytorch_model.bin"])


# reshard-only: options and destination


def bad_max_shard_size(env: Env) -> Setup:
    return Setup(env.tiny_copy("text_only"), ["lots"], args=("--max-shard-size", "lots"))


def zero_max_shard_size(env: Env) -> Setup:
    return Setup(env.tiny_copy("text_only"), ["'0'"], args=("--max-shard-size", "0"))


def out_parent_missing(env: Env) -> Setup:
    out = env.tmp / "no-such-parent" / "out"
    return Setup(env.tiny_copy("text_only"), [out], out=out)


def out_exists_without_force(env: Env) -> Setup:
    out = env.tmp / "out"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    return Setup(env.tiny_copy("text_only"), [out], out=out, out_preexists=True)


def out_inside_src(env: Env) -> Setup:
    src = env.tiny_copy("text_only")
    out = src / "converted"
    return Setup(src, [out, src], out=out)


def out_is_src(env: Env) -> Setup:
    src = env.tiny_copy("text_only")
    return Setup(src, [src], out=src, args=("--force",))


CASES = [
    Case("missing-folder", missing_folder),
    Case("file-instead-of-folder", file_not_folder),
    Case("no-config-json", no_config),
    Case("config-json-is-a-folder", config_is_a_folder),
    Case("config-invalid-json", config_invalid_json),
    Case("config-not-utf8", config_not_utf8),
    Case("config-json-list", config_json_list),
    Case("config-duplicate-keys", config_duplicate_keys),
    Case("config-deeply-nested", config_deeply_nested),
    Case("unknown-model-type", unknown_model_type),
    Case("text-config-not-object", text_config_not_object),
    Case("num-hidden-layers-string", num_hidden_layers_string),
    Case("layer-types-length-mismatch", layer_types_length_mismatch),
    Case("index-missing-shard", index_missing_shard),
    Case("index-shard-dotdot", index_shard_dotdot),
    Case("index-shard-symlink-outside", index_shard_symlink_outside),
    Case("index-lists-absent-tensor", index_lists_absent_tensor),
    Case("tokenizer-symlink-outside", tokenizer_symlink_outside),
    Case("index-without-weight-map", index_without_weight_map),
    Case("index-invalid-json", index_invalid_json),
    Case("duplicate-tensor-via-index", duplicate_tensor_via_index),
    Case("duplicate-tensor-no-index", duplicate_tensor_no_index),
    Case("safetensors-truncated", truncated),
    Case("safetensors-truncated-inside-header", truncated_inside_header),
    Case("safetensors-header-length-past-end", header_length_past_end),
    Case("safetensors-header-not-json", header_not_json),
    Case("safetensors-header-deeply-nested", header_deeply_nested),
    Case("safetensors-header-is-a-list", header_is_a_list),
    Case("safetensors-unknown-dtype", unknown_dtype),
    Case("safetensors-shape-bytes-mismatch", shape_bytes_mismatch),
    Case("safetensors-overlapping-offsets", overlapping_offsets),
    Case("safetensors-empty-file", empty_file),
    Case("pickle-named-model-safetensors", pickle_named_safetensors),
    Case("model-safetensors-is-a-folder", safetensors_is_a_folder),
    Case("model-safetensors-dangling-symlink", safetensors_dangling_symlink),
    Case("only-pytorch-model-bin", only_pytorch_model_bin),
    Case("bad-max-shard-size", bad_max_shard_size, commands=("reshard",)),
    Case("zero-max-shard-size", zero_max_shard_size, commands=("reshard",)),
    Case("out-parent-missing", out_parent_missing, commands=("reshard",)),
    Case("out-exists-without-force", out_exists_without_force, commands=("reshard",)),
    Case("out-inside-src", out_inside_src, commands=("reshard",)),
    Case("out-is-src-with-force", out_is_src, commands=("reshard",)),
]
