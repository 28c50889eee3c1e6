"""A learned reward model as a reward function: ``rewards=[reward_model:PATH]``.

A reward model is a language model with a scalar head, trained on human (or AI) preferences to
score a response to a prompt; its output is the reward RL maximises (Ouyang et al. 2022,
InstructGPT §3.5; Stiennon et al. 2020). Here it is any local Hugging Face directory holding an
``AutoModelForSequenceClassification`` with ``num_labels=1`` and its tokenizer, as TRL's
``RewardTrainer`` saves one. It is combined with verifiers by weight in the Scorer like any
other reward function and logged under its directory's name (``reward/<dir>/mean``).

**What it scores.** ``prompt + completion``, tokenised by the reward model's own tokenizer
without added special tokens: the prompts a trainer passes to rewards are already rendered with
the policy's chat template (``postrl.tasks.chat.build_prompt``), so the text is the chat of
prompt and completion as the policy saw it; a reward model should share that chat format. The
reward is the head's logit, as a float. Texts longer than ``max_length`` tokens lose their
beginning (the completion is what is judged).

**Batching.** Texts go through the model ``batch_size`` at a time, padded on the right, in
``torch.inference_mode`` and eval mode. Sequence-classification heads read the logit at the
rightmost token that is not ``pad_token_id``; with right padding that is the same token as
without padding, so a batched score equals the one-at-a-time score. A tokenizer without a pad
token pads with its end-of-sequence token, and the model's config is given the same id.

**Device.** A reward function's signature (TRL's) carries no device, so a ``RewardModel`` has a
``device`` attribute, a ``device`` option spelling (``auto``, ``cpu``, ``cuda``, ``cuda:N``;
``postrl.devices``). It starts as ``auto``, the rule of the trainer's own default
``device=auto``: the first CUDA GPU when torch sees one, else the CPU. Whoever knows better (a
trainer on another device) sets it; the model moves there on the next call. The weights are
loaded in float32, once per directory and process (``load_reward_model`` caches them), and
never from the network (``local_files_only``).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from postrl.errors import ConfigError

if TYPE_CHECKING:
    import torch

PREFIX = "reward_model"  # the spec is reward_model:PATH
BATCH_SIZE = 8  # texts per forward
DEFAULT_MAX_LENGTH = 2048  # tokens, when the config names no context length

_LOADED: dict[Path, RewardModel] = {}


def reward_model_dir(location: str) -> Path:
    """The absolute directory ``location`` (the PATH of ``reward_model:PATH``) names."""
    return Path(location).expanduser().resolve()


def reward_model_name(location: str) -> str:
    """The name scores are logged under: the directory's name."""
    return reward_model_dir(location).name or PREFIX


class RewardModel:
    """``fn(prompts, completions, **columns) -> list[float]``: the model's scalar score of each
    ``prompt + completion``. ``device`` may be set at any time (see the module docstring)."""

    def __init__(self, model: Any, tokenizer: Any, name: str, *, device: str = "auto",
                 batch_size: int = BATCH_SIZE, max_length: int = DEFAULT_MAX_LENGTH) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.__name__ = name  # the Scorer names a callable by its __name__
        self.device = device
        self.batch_size = batch_size
        self.max_length = max_length
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        tokenizer.padding_side = "right"
        tokenizer.truncation_side = "left"
        config = model.config.get_text_config()  # where the head reads pad_token_id
        if config.pad_token_id is None:
            config.pad_token_id = tokenizer.pad_token_id
        if config.pad_token_id != tokenizer.pad_token_id:  # pad with the id the head skips
            tokenizer.pad_token_id = config.pad_token_id

    def __repr__(self) -> str:
        return f"RewardModel({self.__name__!r}, device={self.device!r})"

    def _on_device(self) -> torch.device:
        from postrl.devices import resolve_device  # torch: imported when first scoring

        device = resolve_device(self.device)
        if next(self.model.parameters()).device != device:
            self.model.to(device)
        return device

    def __call__(self, prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
        import torch

        texts = []
        for index, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
            if not isinstance(prompt, str) or not isinstance(completion, str):
                raise TypeError(f"sample {index}: a reward model scores text, got a "
                                f"{type(prompt).__name__} prompt and a "
                                f"{type(completion).__name__} completion")
            texts.append(prompt + completion)
        device = self._on_device()
        scores: list[float] = []
        with torch.inference_mode():
            for start in range(0, len(texts), self.batch_size):
                batch = self.tokenizer(texts[start:start + self.batch_size], padding=True,
                                       truncation=True, max_length=self.max_length,
                                       add_special_tokens=False, return_tensors="pt")
                logits = self.model(input_ids=batch["input_ids"].to(device),
                                    attention_mask=batch["attention_mask"].to(device)).logits
                scores.extend(logits[:, 0].float().tolist())
        return scores


def load_reward_model(spec: str, location: str) -> RewardModel:
    """The reward model in directory ``location`` (``spec`` is the whole ``reward_model:PATH``,
    for messages), loaded once per directory; ConfigError naming both when it cannot be."""
    path = reward_model_dir(location)
    if path not in _LOADED:
        _LOADED[path] = _load(spec, path)
    return _LOADED[path]


def _fail(spec: str, path: Path, why: str) -> ConfigError:
    return ConfigError(f"reward {spec!r}: {why} (reward model directory {str(path)!r})")


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")


def _load(spec: str, path: Path) -> RewardModel:
    if not path.is_dir():
        raise _fail(spec, path, "no such directory")
    if not (path / "config.json").is_file():
        raise _fail(spec, path, "not a Hugging Face model directory: no config.json")
    import torch
    import transformers

    try:
        config = transformers.AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as error:  # noqa: BLE001 - any unreadable config is the user's to fix
        raise _fail(spec, path, f"cannot read its config: {_first_line(error)}") from error
    architectures = getattr(config, "architectures", None) or []
    if not any(name.endswith("ForSequenceClassification") for name in architectures):
        raise _fail(spec, path, f"not a sequence-classification model (architectures: "
                                f"{architectures}); a reward model is an "
                                "AutoModelForSequenceClassification with num_labels=1")
    if config.num_labels != 1:
        raise _fail(spec, path, f"a reward model has one output, this one num_labels="
                                f"{config.num_labels}")
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        model, info = transformers.AutoModelForSequenceClassification.from_pretrained(
            str(path), config=config, dtype=torch.float32, local_files_only=True,
            output_loading_info=True)
    except Exception as error:  # noqa: BLE001 - safetensors' own errors are plain Exceptions
        raise _fail(spec, path, f"transformers could not load it: {_first_line(error)}") from error
    if info.get("missing_keys"):
        missing = sorted(info["missing_keys"])
        raise _fail(spec, path, f"weights missing from the checkpoint: {missing[:3]}")
    if tokenizer.pad_token_id is None and tokenizer.eos_token_id is None:
        raise _fail(spec, path, "its tokenizer has neither a pad nor an end-of-sequence token")
    max_length = getattr(config, "max_position_embeddings", None) or DEFAULT_MAX_LENGTH
    return RewardModel(model, tokenizer, path.name or PREFIX, max_length=max_length)
