"""`mtp-convert push` against a fake Hub on 127.0.0.1: what arrives, retries, resuming, dry runs, refusals, the token."""

from __future__ import annotations

import json
import logging
import shlex

import pytest
import torch
from safetensors.torch import load_file, save_file

from mtpkit.hub import plan_push
from tests.conftest import run_cli, tree_digest
from tests.hub.conftest import TOKEN, digest, front_matter

# huggingface_hub hands a file object to `data=` for LFS uploads; httpx2 deprecates that. Not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:Use 'content=:DeprecationWarning")
PREFIX = "mtp-convert: error: "
T, D = "me/tiny-e2b", "me/tiny-e2b-assistant"


def _arrived(hub, repo_id: str, branch: str = "main") -> dict[str, str]:
    return {path: digest(data) for path, data in hub.files(repo_id, branch).items() if path != "README.md"}


def _serve_line(card: str) -> str:
    return next(line for line in card.splitlines() if line.startswith("vllm serve "))


def _one_error_line(result) -> str:
    lines = result.err.strip().splitlines()
    assert len(lines) == 1, result.err
    assert lines[0].startswith(PREFIX) and "Traceback" not in result.err, result.err
    return lines[0]


def _commits(hub, repo_id: str) -> list[dict]:
    return [c for c in hub.repos[repo_id].commits if "summary" in c]


# -- (1) what arrives ------------------------------------------------------------------------------------------

def test_push_sends_every_file_byte_identical_with_both_cards(pair_dir, hub, cli):
    result = cli("push", pair_dir, "--repo-id", T)
    assert result.code == 0, result.err
    assert _arrived(hub, T) == tree_digest(pair_dir / "target")
    assert _arrived(hub, D) == tree_digest(pair_dir / "draft")
    assert "model.safetensors" in hub.lfs_files(T) and "model.safetensors" in hub.lfs_files(D)  # the large-file path
    assert "config.json" not in hub.lfs_files(T)
    assert hub.unknown == [] and set(hub.tokens) - {None} == {TOKEN}  # authenticated with HF_TOKEN
    assert len(_commits(hub, T)) == 1 and len(_commits(hub, D)) == 1  # one commit per repo

    target_card, draft_card = hub.files(T)["README.md"].decode(), hub.files(D)["README.md"].decode()
    meta = front_matter(target_card)
    assert meta["library_name"] == "transformers" and meta["pipeline_tag"] == "text-generation"
    assert meta["tags"][:3] == ["speculative-decoding", "mtp", "gemma4"]
    assert "base_model" not in meta and "license" not in meta  # local sources: no Hub id, no source card
    assert "`base_model` is not set" in target_card
    draft_meta = front_matter(draft_card)
    assert "gemma4-assistant" in draft_meta["tags"] and "base_model" not in draft_meta
    for card in (target_card, draft_card):
        serve = _serve_line(card)
        argv = shlex.split(serve)
        assert argv[:3] == ["vllm", "serve", T] and "--kv-cache-dtype" not in argv
        assert json.loads(argv[argv.index("--speculative-config") + 1]) == {"model": D, "num_speculative_tokens": 4}
        assert f'mtpkit.load_pair(target="{T}", draft="{D}")' in card
        assert f"mtp-convert run --target {T} --draft {D}" in card
        assert "assistant_model=assistant" in card and f'from_pretrained("{D}"' in card
        assert f"[{T}]({hub.url}/{T})" in card and f"[{D}]({hub.url}/{D})" in card  # the two repos link each other
        assert "## Acceptance\n\nNot measured." in card
        assert "[head-dim-dialect]" in card  # the conversion report: the draft rules
        assert "`mtp-convert check` passed" in card
        assert str(pair_dir.parent) not in card  # no local path is published
    assert f"serve it with:\n  {_serve_line(target_card)}" in result.out

    # A second push finds everything there: no upload, no commit.
    uploads, requests = sum(hub.uploads.values()), len(hub.requests)
    again = cli("push", pair_dir, "--repo-id", T)
    assert again.code == 0, again.err
    assert "already up to date" in again.out and sum(hub.uploads.values()) == uploads
    assert len(_commits(hub, T)) == 1 and len(_commits(hub, D)) == 1
    assert not [r for r in hub.requests[requests:] if r[1].endswith(("/commit/main", "/preupload/main"))]


def test_quantized_pair_with_hub_origins_gets_base_model_relation_license_and_evaluation(quantized_pair_dir, pair_copy,
                                                                                         hub, cli):
    pair = pair_copy(quantized_pair_dir)
    manifest = json.loads((pair / "pair.json").read_text())
    # As if the sources had come from the Hub (open_source records repo_id / revision / commit).
    manifest["target"].update(repo_id="google/gemma-4-E2B-it", revision=None, commit="a" * 40)
    manifest["draft"].update(repo_id="google/gemma-4-E2B-it-assistant", revision=None, commit="b" * 40)
    (pair / "pair.json").write_text(json.dumps(manifest))
    # `pair` copies the source's model card into target/; its license is carried over, the card replaced.
    (pair / "target" / "README.md").write_text("---\nlicense: apache-2.0\nlibrary_name: transformers\n---\n# Gemma\n")
    result = cli("push", pair, "--repo-id", "me/tiny-nvfp4")
    assert result.code == 0, result.err

    expected = tree_digest(pair / "target")
    del expected["README.md"]
    assert _arrived(hub, "me/tiny-nvfp4") == expected and "mtpkit_quantize.json" in expected
    assert _arrived(hub, "me/tiny-nvfp4-assistant") == tree_digest(pair / "draft")
    card = hub.files("me/tiny-nvfp4")["README.md"].decode()
    meta = front_matter(card)
    assert meta["base_model"] == "google/gemma-4-E2B-it" and meta["base_model_relation"] == "quantized"
    assert meta["license"] == "apache-2.0"
    assert {"nvfp4", "compressed-tensors"} <= set(meta["tags"]) and "fp8-kv-cache" not in meta["tags"]
    draft_meta = front_matter(hub.files("me/tiny-nvfp4-assistant")["README.md"].decode())
    assert draft_meta["base_model"] == "google/gemma-4-E2B-it-assistant" and "base_model_relation" not in draft_meta
    # The quantize report's evaluation numbers, as pair.json holds them.
    evaluation = manifest["target_quantized_by"]["evaluation"]
    assert f"max |logit error| {evaluation['max_abs_logit_error']:.4f}" in card
    ppl = evaluation["perplexity"]
    assert f"perplexity {ppl['original']:.3f} -> {ppl['quantized']:.3f}" in card
    assert "mtp-convert pair --quantize nvfp4a16" in card and "(43 Linear modules)" in card
    assert "commit `" + "a" * 40 + "`" in card


def test_kv_scales_give_the_fp8_kv_cache_flag_and_bench_numbers_fill_acceptance(pair_dir, pair_copy, hub):
    pair = pair_copy(pair_dir)
    tensors = load_file(pair / "target" / "model.safetensors")
    for layer in range(4):
        tensors[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(0.02)
        tensors[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor(0.03)
    save_file(tensors, pair / "target" / "model.safetensors", metadata={"format": "pt"})
    bench = {"prompts": 3, "max_new_tokens": 64, "recommended_k": 2, "kv_cache_dtype": "bfloat16", "results": [
        {"k": 0, "speedup": 1.0, "acceptance_per_position": [], "mean_acceptance_length": 1.0},
        {"k": 2, "speedup": 1.61, "acceptance_per_position": [0.8, 0.5], "mean_acceptance_length": 2.3}]}
    (pair / "bench.json").write_text(json.dumps(bench))
    plan = plan_push(pair, T)
    assert plan.serve.endswith(" --kv-cache-dtype fp8") and plan.serve in plan.target.card
    assert "fp8-kv-cache" not in front_matter(plan.target.card)["tags"]  # BF16 weights: no quantization tags
    assert "| 2 | 2.30 | 80% 50% | 1.61x |" in plan.target.card and "Not measured" not in plan.draft.card
    assert hub.requests == []  # planning sends nothing


# -- (2) transient failures --------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["create", "tree", "preupload", "batch", "upload", "commit", "commit-lost"])
def test_a_transient_5xx_is_retried_and_the_push_completes(pair_dir, hub, cli, kind):
    hub.fail_next[kind] = [503]
    result = cli("push", pair_dir, "--repo-id", T)
    assert result.code == 0, result.err
    assert hub.fail_next[kind] == []  # the fault was hit
    assert _arrived(hub, T) == tree_digest(pair_dir / "target") and _arrived(hub, D) == tree_digest(pair_dir / "draft")
    assert len(_commits(hub, T)) == 1 and len(_commits(hub, D)) == 1  # a lost commit answer is not committed twice
    assert all(count == 1 for count in hub.uploads.values())
    if kind in ("create", "commit", "commit-lost"):  # huggingface_hub does not retry these: we do, with backoff
        assert hub.sleeps == [2.0] and "retrying in 2 s (try 2 of 4)" in result.err and "HTTP 503" in result.err


def test_a_persistent_5xx_fails_with_one_clear_line(pair_dir, hub, cli):
    hub.fail_next["commit"] = [500] * 10
    result = cli("push", pair_dir, "--repo-id", T)
    assert result.code == 1
    line = result.err.strip().splitlines()[-1]
    assert line.startswith(PREFIX + D + ": committing failed after 4 tries (HTTP 500")
    assert "run the same command again" in line and hub.sleeps == [2.0, 4.0, 8.0]


# -- (3) a dropped connection, then a re-run ---------------------------------------------------------------------

def test_a_dropped_upload_fails_clearly_and_a_rerun_sends_nothing_twice(sharded_pair_dir, hub, cli):
    shards = sorted((sharded_pair_dir / "target").glob("*.safetensors"))
    last = shards[-1]
    hub.drop_oids = {digest(last.read_bytes())}  # the connection drops on every try of the last shard
    result = cli("push", sharded_pair_dir, "--repo-id", T)
    assert result.code == 1
    line = result.err.strip().splitlines()[-1]
    assert line.startswith(f"{PREFIX}{T}: uploading {last.name} failed after 4 tries (")
    assert "run the same command again: what is already on the Hub is not sent again" in line
    assert hub.upload_attempts[digest(last.read_bytes())] > 1 and digest(last.read_bytes()) not in hub.lfs
    assert len(_commits(hub, D)) == 1 and _commits(hub, T) == []  # the assistant is complete; the target unchanged
    for shard in shards[:-1]:  # uploaded, not yet committed
        assert hub.uploads[digest(shard.read_bytes())] == 1

    hub.drop_oids.clear()
    rerun = cli("push", sharded_pair_dir, "--repo-id", T)
    assert rerun.code == 0, rerun.err
    assert _arrived(hub, T) == tree_digest(sharded_pair_dir / "target")
    assert _arrived(hub, D) == tree_digest(sharded_pair_dir / "draft")
    assert f"{D}: already up to date" in rerun.out and len(_commits(hub, D)) == 1
    blobs = {digest(p.read_bytes()) for folder in ("target", "draft")
             for p in (sharded_pair_dir / folder).glob("*.safetensors")}
    assert set(hub.uploads) == blobs and all(hub.uploads[oid] == 1 for oid in blobs)  # each blob sent once


def test_a_single_dropped_connection_is_retried_within_the_push(sharded_pair_dir, hub, cli):
    hub.drop_uploads = 1
    result = cli("push", sharded_pair_dir, "--repo-id", T)
    assert result.code == 0, result.err
    assert _arrived(hub, T) == tree_digest(sharded_pair_dir / "target")
    assert all(count == 1 for count in hub.uploads.values()) and sum(hub.upload_attempts.values()) == \
        len(hub.uploads) + 1


# -- (4) dry run ---------------------------------------------------------------------------------------------------

def test_dry_run_sends_nothing_and_prints_the_plan_and_cards(pair_dir, hub, cli):
    result = cli("push", pair_dir, "--repo-id", T, "--dry-run")
    assert result.code == 0, result.err
    assert hub.requests == []
    out = result.out
    assert out.startswith("dry run: nothing is sent\n")
    assert f"{T} (target): 4 files" in out and f"{D} (assistant): 5 files" in out
    size = (pair_dir / "target" / "model.safetensors").stat().st_size
    assert f"{size / 1000:.1f} kB" in out and "(model card, generated)" in out
    assert f"--- README.md of {T} ---\n---\n" in out and f"--- README.md of {D} ---\n---\n" in out
    plan = plan_push(pair_dir, T)
    assert plan.target.card in out and plan.draft.card in out  # the exact card text that would be sent
    assert "token: from HF_TOKEN" in out and TOKEN not in out


# -- (5) the token -------------------------------------------------------------------------------------------------

def _run_fd(capfd, *args):
    """Like the `cli` fixture, but capturing the file descriptors (a logging handler may hold the real stderr)."""
    result = run_cli(capfd, *args)
    return result.code, result.out, result.err


def test_the_token_is_never_printed_logged_or_written(pair_dir, pair_copy, hub, capfd, caplog, monkeypatch, tmp_path):
    from huggingface_hub import constants

    monkeypatch.setenv("MTPKIT_DEBUG", "1")  # tracebacks on
    monkeypatch.setattr(constants, "HF_DEBUG", True)  # huggingface_hub logs every request as a curl command
    caplog.set_level(logging.DEBUG)
    for name in ("huggingface_hub", "httpx2", "httpcore", "mtpkit"):
        caplog.set_level(logging.DEBUG, logger=name)
    pair = pair_copy(pair_dir)
    hub.fail_next["commit"] = [502]  # a retry message too
    code, out, err = _run_fd(capfd, "push", pair, "--repo-id", T)
    assert code == 0, err
    assert "curl -X POST -H" in caplog.text and "<TOKEN>" in caplog.text  # request logging (headers) was on
    hub.token = "hf_SomeoneElsesTokenAbcdefghijklmnopqrstuv"  # now the Hub rejects ours: the error path
    code2, out2, err2 = _run_fd(capfd, "push", pair, "--repo-id", "me/other")
    assert code2 == 2 and "rejected the token" in err2
    for text in (out, err, out2, err2, caplog.text):
        assert TOKEN not in text
    for path in [*tmp_path.rglob("*"), *pair_dir.rglob("*")]:
        if path.is_file():
            assert TOKEN.encode() not in path.read_bytes(), path
    assert set(hub.tokens) - {None} == {TOKEN}


# -- (6) refusals ------------------------------------------------------------------------------------------------

def test_a_pair_failing_check_is_refused_and_force_pushes_it_with_a_warning(pair_dir, pair_copy, hub, cli):
    pair = pair_copy(pair_dir)
    config = json.loads((pair / "draft" / "config.json").read_text())
    config["backbone_hidden_size"] = 999
    (pair / "draft" / "config.json").write_text(json.dumps(config))
    result = cli("push", pair, "--repo-id", T)
    assert result.code == 2 and result.out == ""
    line = _one_error_line(result)
    assert "fails `mtp-convert check`" in line and "[backbone-hidden-size]" in line and "--force" in line
    assert str(pair / "draft" / "config.json") in line
    assert hub.requests == []

    forced = cli("push", pair, "--repo-id", T, "--force")
    assert forced.code == 0, forced.err
    assert "pushing despite a failed check (--force): [backbone-hidden-size]" in forced.err
    for repo in (T, D):
        assert "`mtp-convert check` FAILED with 3 error(s)" in hub.files(repo)["README.md"].decode()


@pytest.mark.parametrize("name, what", [
    ("model.bin", "a pickle file"), ("weights.pt", "a pickle file"), (".env", "an environment file"),
    ("id_rsa", "an SSH key"), ("server.pem", "a key or certificate file"), ("hf_token", "a token file"),
    ("sub/.git-credentials", "a credentials file"), ("config.json~", "an editor backup"),
    (".config.json.swp", "an editor backup"), (".DS_Store", "an operating-system file"),
    (".cache/huggingface/download/x.metadata", "a hidden file"), ("notes.txt", "a file that holds your Hugging Face token"),
])
def test_files_that_should_not_be_published_are_refused_and_force_leaves_them_out(pair_dir, pair_copy, hub, cli,
                                                                                  name, what):
    pair = pair_copy(pair_dir)
    stray = pair / "target" / name
    stray.parent.mkdir(parents=True, exist_ok=True)
    stray.write_text(f"token={TOKEN}\n" if name == "notes.txt" else "x")
    result = cli("push", pair, "--repo-id", T)
    assert result.code == 2 and result.out == ""
    line = _one_error_line(result)
    assert line.startswith(f"{PREFIX}{stray}: is {what}") and "--force" in line and TOKEN not in line
    assert hub.requests == []

    forced = cli("push", pair, "--repo-id", T, "--force")
    assert forced.code == 0, forced.err
    assert f"left out (--force): {stray}" in forced.err
    assert name not in hub.files(T) and _arrived(hub, T) == {
        k: v for k, v in tree_digest(pair / "target").items() if k != name}


def test_tokenizer_and_config_files_are_not_mistaken_for_secrets():
    from pathlib import PurePosixPath

    from mtpkit.hub.screen import classify_name

    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                 "tokenizer.model", "chat_template.jinja", "generation_config.json", "config.json", "README.md",
                 "LICENSE", "model-00001-of-00002.safetensors", "model.safetensors.index.json", "mtpkit_draft.json"):
        assert classify_name(PurePosixPath(name)) is None, name


@pytest.mark.parametrize("args, expect", [
    (["--repo-id", "not-a-repo-id"], "--repo-id: 'not-a-repo-id' is not a Hub repo id OWNER/NAME"),
    (["--repo-id", "me/x", "--draft-repo-id", "me/x"], "--draft-repo-id: the target and the assistant need two repos"),
    (["--repo-id", "me/x", "--revision", "a" * 40], "is not a branch name that can be pushed to"),
])
def test_bad_options_are_refused_before_anything_is_read_or_sent(pair_dir, hub, cli, args, expect):
    result = cli("push", pair_dir, *args)
    assert result.code == 2 and expect in _one_error_line(result) and hub.requests == []


def test_a_folder_that_is_not_a_pair_is_refused(tiny, hub, cli, tmp_path):
    result = cli("push", tiny("e2b_like"), "--repo-id", T)
    assert result.code == 2 and "has no target/ folder" in _one_error_line(result) and hub.requests == []


# -- options -------------------------------------------------------------------------------------------------------

def test_revision_pushes_to_a_new_branch_and_the_cards_name_it(pair_dir, hub, cli):
    result = cli("push", pair_dir, "--repo-id", T, "--revision", "nvfp4", "--commit-message", "first cut")
    assert result.code == 0, result.err
    assert _arrived(hub, T, "nvfp4") == tree_digest(pair_dir / "target") and hub.files(T) == {}
    assert [c["summary"] for c in _commits(hub, T)] == ["first cut"]
    serve = shlex.split(_serve_line(hub.files(T, "nvfp4")["README.md"].decode()))
    assert serve[3:5] == ["--revision", "nvfp4"]
    assert json.loads(serve[serve.index("--speculative-config") + 1])["revision"] == "nvfp4"


def test_private_creates_private_repos_and_refuses_an_existing_public_one(pair_dir, hub, cli):
    assert cli("push", pair_dir, "--repo-id", T, "--private").code == 0
    assert hub.repos[T].private and hub.repos[D].private
    assert cli("push", pair_dir, "--repo-id", "me/public").code == 0
    uploads = dict(hub.uploads)
    result = cli("push", pair_dir, "--repo-id", "me/public", "--private")
    assert result.code == 2 and "exists and is public, but --private was given" in _one_error_line(result)
    assert hub.uploads == uploads


def test_files_the_hub_holds_but_the_pair_lacks_are_reported(pair_dir, hub, cli):
    assert cli("push", pair_dir, "--repo-id", T).code == 0
    hub.repos[T].branches["main"]["old-model.safetensors"] = b"stale"
    result = cli("push", pair_dir, "--repo-id", T)
    assert result.code == 0 and f"{T} also holds files this pair does not have: old-model.safetensors" in result.err


def test_no_token_is_refused_before_any_request(pair_dir, hub, cli, monkeypatch):
    monkeypatch.delenv("HF_TOKEN")
    result = cli("push", pair_dir, "--repo-id", T)
    last = result.err.strip().splitlines()[-1]
    assert result.code == 2 and last.startswith(PREFIX + "push: no Hugging Face token") and hub.requests == []


def test_layering_hub_imports_neither_cli_runtime_nor_calibrate_and_the_command_only_calls_hub():
    import ast
    from pathlib import Path

    import mtpkit

    root = Path(mtpkit.__file__).parent
    for path in [*(root / "hub").glob("*.py"), root / "cli" / "push_cmd.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for name in names:
                if not name.startswith("mtpkit"):
                    continue
                allowed = ("mtpkit.cli", "mtpkit.hub") if path.name == "push_cmd.py" else \
                    ("mtpkit.convert", "mtpkit.formats", "mtpkit.errors", "mtpkit.hub")
                assert name.startswith(allowed), (path.name, name)
