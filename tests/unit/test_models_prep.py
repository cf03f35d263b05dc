"""The offline model builder: tiny-llama geometry, tokenizer round-trip and the cache marker.

Builds into a temporary directory (about 2-8 s on 2 cores), so it never touches the shared
`.models` cache and needs no network.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_layerkv.testing import models


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("models")
    return models.model_path("tiny-llama", root)


def test_tiny_llama_config(tiny_dir: Path) -> None:
    cfg = json.loads((tiny_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["num_hidden_layers"] == 8
    assert cfg["num_key_value_heads"] == 2
    assert cfg["num_attention_heads"] == 4
    assert cfg["head_dim"] == 64
    assert cfg["hidden_size"] == 256
    assert cfg["vocab_size"] == 4096
    assert cfg["max_position_embeddings"] == 4096
    # patched for transformers-4.x readers (see models._patch_for_4x_readers)
    assert cfg["rope_theta"] == pytest.approx(10000.0)
    assert (tiny_dir / "model.safetensors").is_file()
    tok_cfg = json.loads((tiny_dir / "tokenizer_config.json").read_text())
    assert tok_cfg["tokenizer_class"] == "PreTrainedTokenizerFast"


def test_tiny_llama_tokenizer_round_trip(tiny_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_dir))
    assert len(tok) == 4096
    text = "def layer_group(kv, start=0):\n    return kv[start:]  # naïve ✓"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert 0 < len(ids) < len(text.encode())  # BPE merged something
    assert tok.decode(ids) == text  # byte-level BPE is lossless, non-ASCII included
    with_bos = tok(text)["input_ids"]
    assert with_bos[0] == tok.bos_token_id and with_bos[1:] == ids


def test_marker_and_second_call_is_noop(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    marker = json.loads((tiny_dir / models.MARKER).read_text())
    assert marker["name"] == "tiny-llama"
    assert marker["recipe_version"] == models.RECIPES["tiny-llama"].version
    assert set(marker["safetensors_sha256"]) == {"model.safetensors"}
    assert models.is_prepared("tiny-llama", tiny_dir.parent)
    # no leftovers from the atomic build
    assert not [p.name for p in tiny_dir.parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name]

    def _must_not_build(out: Path) -> None:
        raise AssertionError("recipe rebuilt although the .complete marker is current")

    recipe = models.RECIPES["tiny-llama"]
    monkeypatch.setitem(
        models.RECIPES, "tiny-llama",
        models.Recipe(recipe.name, recipe.version, _must_not_build, "")
    )
    mtime = (tiny_dir / "model.safetensors").stat().st_mtime_ns
    assert models.model_path("tiny-llama", tiny_dir.parent) == tiny_dir
    assert (tiny_dir / "model.safetensors").stat().st_mtime_ns == mtime


def test_unknown_model_name(tmp_path: Path) -> None:
    with pytest.raises(models.ModelPrepError, match="unknown model"):
        models.model_path("no-such-model", tmp_path)
