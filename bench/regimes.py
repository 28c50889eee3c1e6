"""What `make bench` measures, and the least time a step of it could take on this machine.

A regime is a task, a response budget and a reward that both frameworks get:

- ``short``: single-digit additions, at most 64 new tokens, ``math_answer`` (answers are ~20
  tokens; most of a step is fixed overhead);
- ``gsm8k-256`` and ``gsm8k-1024``: GSM8K questions, at most 256 or 1,024 new tokens, the
  regime reasoning RL lives in, scored by :func:`answer_closeness`.

Why not GSM8K's own verifier: SmolLM2-135M solves almost no GSM8K problem, so nearly every
group scores all zeros, postrl skips the update of such groups (their gradient is exactly
zero) and TRL does not: the ratio would measure that, not the update. Closeness to the gold
answer gives every response a different score, so both frameworks train every row.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from postrl.rewards.math_answer import completion_text, extract_answer, gold_answer, parse_number

# the shared data folder beside the repository (../shared/data), where this project keeps it
GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k" / "train.jsonl"


@dataclass(frozen=True)
class Regime:
    name: str
    task: str  # "arithmetic" or "gsm8k"
    max_new_tokens: int
    reward: str  # "math_answer" or "answer_closeness"
    steps: int  # timed steps per child by default: fewer where a step takes minutes
    # TRL's rows per forward and backward (its per_device_train_batch_size; gradient
    # accumulation makes up a step's 32): the most of 32's divisors whose rows, padded to the
    # budget and a long prompt (GSM8K's: 42-253 tokens, median 86), hold no more tokens than
    # postrl's micro-batches (vs_trl.MICRO_BATCH_TOKENS). All 32 rows at once at 256 new
    # tokens do not fit TRL's fp32 backward in 21.2 GB (90% of a 24 GB machine).
    trl_micro_batch: int = 32
    data: Path | None = None  # the task's data file (GSM8K's train.jsonl)


REGIMES = {regime.name: regime for regime in (
    Regime("short", "arithmetic", 64, "math_answer", steps=3),
    Regime("gsm8k-256", "gsm8k", 256, "answer_closeness", steps=2, trl_micro_batch=8,
           data=GSM8K),
    Regime("gsm8k-1024", "gsm8k", 1024, "answer_closeness", steps=1, trl_micro_batch=2,
           data=GSM8K),
)}
SHORT = REGIMES["short"]


def parse_regimes(names: str, gsm8k: Path = GSM8K) -> list[Regime]:
    """``"short,gsm8k-256"`` to its regimes, the GSM8K ones reading ``gsm8k``; SystemExit
    naming an unknown regime or a missing data file."""
    unknown = [n for n in names.split(",") if n not in REGIMES]
    if unknown:
        raise SystemExit(f"--regimes: unknown {', '.join(unknown)}; known: {', '.join(REGIMES)}")
    regimes = [dataclasses.replace(REGIMES[n], data=gsm8k) if REGIMES[n].data else REGIMES[n]
               for n in names.split(",")]
    for regime in regimes:
        task_spec(regime)
    return regimes


def task_spec(regime: Regime) -> str:
    """postrl's task spec; SystemExit naming a missing data file and ``--gsm8k``."""
    if regime.data is None:
        return regime.task
    if not regime.data.is_file():
        raise SystemExit(f"regime {regime.name}: {regime.task} data {str(regime.data)!r} does "
                         "not exist; pass --gsm8k PATH (a GSM8K train.jsonl)")
    return f"{regime.task}:{regime.data}"


def reward_spec(regime: Regime) -> str:
    """postrl's ``rewards`` entry for ``regime``: a built-in or this file's function."""
    return regime.reward if regime.reward == "math_answer" else f"{__file__}:{regime.reward}"


def answer_closeness(prompts: list[str], completions: list[Any], answer: list[Any],
                     **_: Any) -> list[float]:
    """``1 / (1 + |x - y| / max(|y|, 1))`` for the completion's final number x and the gold
    answer y: 1 when right, less the further off; 0 without a number. A benchmark's reward (it
    varies within groups), not one to train a model with."""
    rewards = []
    for completion, gold in zip(completions, answer, strict=True):
        predicted = extract_answer(completion_text(completion))
        x = parse_number(predicted) if predicted is not None else None
        y = parse_number(gold_answer(gold) or "")
        rewards.append(0.0 if x is None or y is None
                       else float(1 / (1 + abs(x - y) / max(abs(y), 1))))
    return rewards


def gradient_rows(trainer, batch) -> torch.Tensor:
    """The rows of ``batch`` whose update runs forward and backward: with one update per batch
    the rows without a gradient (groups whose rewards are all equal) run none
    (``postrl/train/row_skipping.py``)."""
    from postrl.train.row_skipping import unscored_rows_possible, zero_gradient_rows

    cfg = trainer.cfg
    loss_cfg = trainer.recipe.policy_loss_config(cfg.max_new_tokens)
    every = torch.arange(batch.rows)
    if not unscored_rows_possible(trainer.recipe, loss_cfg, cfg.updates_per_batch):
        return every
    return every[~zero_gradient_rows(every, batch, loss_cfg, trainer.critic is not None)]


def trained_tokens(trainer, batch) -> tuple[int, int]:
    """``(rows, tokens)`` the update of ``batch`` runs forward and backward: the responses of
    :func:`gradient_rows` and each of their prompts once per group (rows of a prompt share its
    forward, ``postrl/models/logprobs.py``; a prompt whose rows fall into several micro-batches
    runs once in each, so an achieved FLOP/s from this count is a lower bound)."""
    rows = gradient_rows(trainer, batch).tolist()
    return len(rows), _trained(batch, rows)


def _trained(batch, rows: list[int]) -> int:
    """The responses of ``rows`` and each of their groups' prompts once."""
    groups = {i // batch.group_size for i in rows}
    return (int(batch.response_mask[rows].sum())
            + sum(len(batch.prompt_ids[g * batch.group_size]) for g in groups))


@dataclass(frozen=True)
class StepWork:
    """What one step of a batch must compute and read, in tokens and attention pairs (a
    query-key pair of one layer; causal: a token at position t attends to t positions)."""
    params: int
    layers: int
    width: int  # query heads x head size
    kv_bytes_per_token: int  # every layer's keys and values of one token, as the sampler keeps them
    weight_bytes: int  # the sampling weights, read once per decode step
    prompt_tokens: int  # each prompt once (its rows share the prefill)
    prompt_pairs: int
    generated: int
    generated_pairs: int
    decode_steps: int  # the longest response
    trained: int  # the update's tokens (trained_tokens)
    trained_pairs: int


def _pairs(prompt: int, response: int) -> int:
    """Attention pairs of ``response`` tokens decoded after a ``prompt``-token context."""
    return response * prompt + response * (response + 1) // 2


def step_work(trainer, batch) -> StepWork:
    from postrl.models.precision import sampling_dtype

    config = trainer.lm.config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    itemsize = sampling_dtype(trainer.cfg.precision, trainer.lm.dtype).itemsize
    params = sum(p.numel() for p in trainer.lm.parameters())
    prompts = [len(batch.prompt_ids[g * batch.group_size])
               for g in range(batch.rows // batch.group_size)]
    lengths = [int(n) for n in batch.lengths]
    pairs = [_pairs(prompts[i // batch.group_size], n) for i, n in enumerate(lengths)]
    rows = gradient_rows(trainer, batch).tolist()
    groups = sorted({i // batch.group_size for i in rows})
    return StepWork(
        params=params, layers=config.num_hidden_layers, width=heads * head_dim,
        kv_bytes_per_token=(2 * config.num_hidden_layers * config.num_key_value_heads
                            * head_dim * itemsize),
        weight_bytes=params * itemsize,
        prompt_tokens=sum(prompts), prompt_pairs=sum(_pairs(0, p) for p in prompts),
        generated=sum(lengths), generated_pairs=sum(pairs), decode_steps=max(lengths, default=0),
        trained=_trained(batch, rows),
        trained_pairs=(sum(pairs[i] for i in rows) + sum(_pairs(0, prompts[g]) for g in groups)))


def roofline_s(work: StepWork | dict, peak_gflops: float, bandwidth_gbs: float) -> float:
    """The least time a step could take on a machine with this matmul peak and memory-read
    rate: the sampler's forward, the update's backward, and decoding bound by the larger of
    its arithmetic and its reads.

    FLOPs per token: 2 per weight forward, 4 backward (Kaplan et al. 2020, arXiv 2001.08361,
    §2.1), and per attention pair and layer 4 x width forward (scores and values), 8 backward.
    The update's forward is the sampler's (one update per batch, the weights unchanged): the
    least work is a forward of every prompt and generated token and a backward of the trained
    ones. Decoding reads every sampling weight once per step and each context token's keys
    and values once per generated token. Element-wise work, the optimizer and the vocabulary's
    softmax are left out: a floor, not a model.
    """
    w = StepWork(**work) if isinstance(work, dict) else work
    peak, rate = peak_gflops * 1e9, bandwidth_gbs * 1e9
    attention = 4 * w.layers * w.width
    prefill = 2 * w.params * w.prompt_tokens + attention * w.prompt_pairs
    decode_flops = 2 * w.params * w.generated + attention * w.generated_pairs
    decode_bytes = w.decode_steps * w.weight_bytes + w.kv_bytes_per_token * w.generated_pairs
    backward = 4 * w.params * w.trained + 2 * attention * w.trained_pairs
    return (prefill + backward) / peak + max(decode_flops / peak, decode_bytes / rate)


def as_dict(work: StepWork) -> dict:
    return dataclasses.asdict(work)
