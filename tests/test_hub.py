"""Hugging Face hub ids as model paths: found in a Hugging Face cache laid out here by hand (no network), the same
for `evenrl plan` and `evenrl train`; a model that is not there is one line naming the download command."""

from __future__ import annotations

import shutil

import pytest

from e2e import evenrl_here
from evenrl.config import load_config
from evenrl.models.hub import is_hub_id, resolve_models


@pytest.fixture
def hub_cache(assets, tmp_path, monkeypatch):
    """A cache holding `tiny-org/tiny-qwen` (the assets' model) as huggingface_hub lays one out: the main ref
    naming a commit, the files under snapshots/<commit>/."""
    cache = tmp_path / "hub"
    repo = cache / "models--tiny-org--tiny-qwen"
    shutil.copytree(assets["model"], repo / "snapshots" / "0123abc")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abc")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return repo / "snapshots" / "0123abc"


def test_hub_ids_resolve_from_the_cache_for_every_model_field(hub_cache, assets):
    judge = "rewards.functions=[{judge: {model: tiny-org/tiny-qwen, template: '{completion}'}}]"
    cfg = load_config(assets["cfg"], ["model.path=tiny-org/tiny-qwen", "critic.path=tiny-org/tiny-qwen", judge])
    got = resolve_models(cfg, download=False)
    assert got.model.path == got.critic.path == got.rewards.functions[0].judge.model == str(hub_cache)
    assert resolve_models(load_config(assets["cfg"]), download=False).model.path == str(assets["model"])


def test_a_local_directory_is_never_a_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert is_hub_id("org/name") and is_hub_id("Qwen/Qwen2.5-0.5B-Instruct")
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert not is_hub_id("org/name")  # there: a path
    assert not any(map(is_hub_id, ["/abs/path", "./rel/x", "a/b/c", "name", "org/", "~/x", ""]))


def test_plan_and_train_find_a_cached_model_and_name_the_download_command_otherwise(hub_cache, assets, tmp_path,
                                                                                      capsys, monkeypatch):
    code, out, err = evenrl_here(capsys, "plan", assets["cfg"], "model.path=tiny-org/tiny-qwen")
    assert code in (0, 1) and "model-path" not in out and not err, (out, err)  # planned on the cached files
    code, out, err = evenrl_here(capsys, "plan", assets["cfg"], "model.path=tiny-org/missing")
    assert code == 2 and err.strip().splitlines() == [
        "evenrl plan: error: model.path: 'tiny-org/missing' is neither a local directory nor in the Hugging Face "
        f"cache ({tmp_path / 'hub'}); evenrl plan never downloads: download it with `hf download tiny-org/missing`"]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, out, err = evenrl_here(capsys, "train", assets["cfg"], "model.path=tiny-org/missing",
                                 f"log.run_dir={tmp_path / 'run'}", "--nproc-per-node", "2")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "HF_HUB_OFFLINE is set: download it with `hf download tiny-org/missing`" in err
    assert not (tmp_path / "run").exists()
