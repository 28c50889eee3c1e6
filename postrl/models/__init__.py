"""Models: loading (bundled SmolLM2, local directories, a tiny test model)."""

from postrl.models.loading import SMOLLM2, TINY, cache_dir, load_policy, load_tokenizer

__all__ = ["SMOLLM2", "TINY", "cache_dir", "load_policy", "load_tokenizer"]
