"""The disk cache of built models: a second load reads it back (same logits); stale or corrupt entries are rebuilt."""

from __future__ import annotations

import json
import os

import pytest
import torch

from refusion import cache_dirs
from refusion.model import build_cache, loading
from refusion.model.setup import setup_of

PROMPT = torch.tensor([[1, 5, 7, 9, 63, 63, 11]])  # 63: <|mask|>, added to the base by the adapter's load


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    path = tmp_path / "cache"
    monkeypatch.setenv("REFUSION_CACHE", str(path))
    return path


@pytest.fixture
def builds(monkeypatch):
    """Counts the loads that really built the model (not read from the cache)."""
    calls = []
    build = loading._build

    def counting_build(*args, **kwargs):
        calls.append(args)
        return build(*args, **kwargs)

    monkeypatch.setattr(loading, "_build", counting_build)
    return calls


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(PROMPT).logits


def _entries(cache_dir):
    return sorted(p for p in (cache_dir / "models").iterdir() if not p.name.startswith("."))


def _load(adapter_dir):
    return loading.load(adapter_dir, dtype="bfloat16", device="cpu")


def test_second_load_reads_the_cache_and_gives_identical_logits(adapter_dir, cache_dir, builds, monkeypatch):
    monkeypatch.setenv("REFUSION_CACHE", "off")
    uncached, _ = _load(adapter_dir)
    assert len(builds) == 1 and not cache_dir.exists()

    monkeypatch.setenv("REFUSION_CACHE", str(cache_dir))
    first, _ = _load(adapter_dir)  # builds and stores
    assert len(builds) == 2 and len(_entries(cache_dir)) == 1
    second, tokenizer = _load(adapter_dir)  # read back
    assert len(builds) == 2
    assert second.dtype == torch.bfloat16
    assert torch.equal(_logits(second), _logits(uncached)) and torch.equal(_logits(first), _logits(uncached))
    assert setup_of(second).special_tokens == setup_of(uncached).special_tokens
    assert setup_of(second).special_tokens.mask_token_id == tokenizer.convert_tokens_to_ids("<|mask|>") == 63
    manifest = json.loads((_entries(cache_dir)[0] / build_cache.MANIFEST).read_text())
    assert manifest["inputs"]["dtype"] == "bfloat16" and "model.safetensors" in manifest["files"]
    assert {f["name"] for f in manifest["key"]["adapter_files"]} >= {"adapter_config.json"}


def test_another_dtype_is_another_entry(adapter_dir, cache_dir, builds):
    _load(adapter_dir)
    loading.load(adapter_dir, dtype="float32", device="cpu")
    _load(adapter_dir)
    assert len(builds) == 2 and len(_entries(cache_dir)) == 2


@pytest.mark.parametrize("change", ["adapter file", "package version"])
def test_a_stale_key_rebuilds_and_replaces_the_old_entry(adapter_dir, cache_dir, builds, monkeypatch, change):
    reference, _ = _load(adapter_dir)
    old_entry = _entries(cache_dir)
    if change == "adapter file":
        config_path = adapter_dir / "adapter_config.json"
        config = json.loads(config_path.read_text())
        config_path.write_text(json.dumps({**config, "lora_alpha": 16}))  # a different merge
    else:
        versions = build_cache.versions
        monkeypatch.setattr(build_cache, "versions", lambda *names: {**versions(*names), "transformers": "99.0"})
    rebuilt, _ = _load(adapter_dir)
    assert len(builds) == 2
    assert _entries(cache_dir) != old_entry and len(_entries(cache_dir)) == 1  # the stale entry is gone
    if change == "adapter file":
        assert not torch.equal(_logits(rebuilt), _logits(reference))
    again, _ = _load(adapter_dir)
    assert len(builds) == 2 and torch.equal(_logits(again), _logits(rebuilt))


def _truncate(entry):
    path = entry / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip_bytes(entry):
    path = entry / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-100:-90] = bytes(10)  # inside the tensor data: same size, other weights
    path.write_bytes(bytes(data))


def _drop_manifest(entry):
    (entry / build_cache.MANIFEST).unlink()


def _garble_manifest(entry):
    (entry / build_cache.MANIFEST).write_text("{not json")


def _forge_manifest(entry):
    """A manifest that matches the corrupt file: the key still has to match, and the file must load."""
    path = entry / "model.safetensors"
    path.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{\"a\": 1}")
    manifest = json.loads((entry / build_cache.MANIFEST).read_text())
    manifest["files"]["model.safetensors"] = {"size": path.stat().st_size, "sha256": build_cache.sha256_file(path)}
    (entry / build_cache.MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.parametrize("corrupt", [_truncate, _flip_bytes, _drop_manifest, _garble_manifest, _forge_manifest])
def test_a_corrupt_entry_is_rebuilt_never_trusted(adapter_dir, cache_dir, builds, corrupt, capsys):
    reference, _ = _load(adapter_dir)
    expected = _logits(reference)
    del reference  # its weights map the entry's file, which `corrupt` rewrites in place
    corrupt(_entries(cache_dir)[0])
    rebuilt, _ = _load(adapter_dir)
    assert len(builds) == 2 and "rebuilding" in capsys.readouterr().err
    assert torch.equal(_logits(rebuilt), expected)
    again, _ = _load(adapter_dir)  # the rebuilt entry is whole again
    assert len(builds) == 2 and torch.equal(_logits(again), expected)


def test_an_unchanged_entry_is_not_hashed_again_and_a_touched_one_is(adapter_dir, cache_dir, builds, monkeypatch):
    """Files with the size and modification time recorded at writing are trusted without hashing (the weights' hash
    was most of a cold start's cache check); a file touched since (same bytes) is hashed, found whole and used."""
    reference, _ = _load(adapter_dir)
    hashed = []
    sha256_file = build_cache.sha256_file
    entry = _entries(cache_dir)[0]
    monkeypatch.setattr(build_cache, "sha256_file",  # (the adapter's own files are hashed for the key)
                        lambda path: (path.parent == entry and hashed.append(path.name)) or sha256_file(path))
    again, _ = _load(adapter_dir)
    assert len(builds) == 1 and hashed == []
    weights = entry / "model.safetensors"
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    touched, _ = _load(adapter_dir)
    assert len(builds) == 1 and hashed == ["model.safetensors"]
    assert torch.equal(_logits(touched), _logits(reference)) and torch.equal(_logits(again), _logits(reference))


def test_an_unwritable_cache_still_loads(adapter_dir, tmp_path, builds, monkeypatch, capsys):
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("REFUSION_CACHE", str(tmp_path / "a-file" / "cache"))
    model, _ = _load(adapter_dir)
    assert len(builds) == 1 and "continuing without it" in capsys.readouterr().err
    assert setup_of(model).special_tokens.mask_token_id == 63


def test_plain_directories_are_not_cached(tiny_model_dir, cache_dir):
    loading.load(tiny_model_dir, dtype="float32", device="cpu")
    assert not (cache_dir / "models").exists()  # (the calibration record beside it may hold its kernel choice)


def test_cache_location(monkeypatch, tmp_path):
    monkeypatch.setenv("REFUSION_CACHE", str(tmp_path))
    assert cache_dirs.cache_root() == tmp_path / "models"
    monkeypatch.setenv("REFUSION_CACHE", "off")
    assert cache_dirs.cache_root() is None
    monkeypatch.delenv("REFUSION_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dirs.cache_root() == tmp_path / "xdg" / "refusion" / "models"
