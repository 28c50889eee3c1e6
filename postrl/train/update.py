"""Policy (and critic) updates on one batch: epochs x minibatches optimizer steps, each over
micro-batches whose losses are normalised by the minibatch's GLOBAL counts (§3).

The same loop serves one process and data-parallel replicas (``postrl.train.distributed``): the
driver draws the plan (which rows make each optimizer step) so that it never depends on the
number of replicas; each replica takes a contiguous share of every minibatch, and the results
of all replicas merge into the metrics of the whole batch.
"""

from __future__ import annotations

import dataclasses
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from postrl.models.logprobs import SequenceBatch
from postrl.models.precision import MasterWeights, autocast, float32_module_autocast
from postrl.objectives import (
    BatchCounts,
    Diagnostics,
    PolicyLossConfig,
    PolicyLossInputs,
    aggregate,
    clipped_value_loss,
    policy_loss,
)
from postrl.recipes import Recipe
from postrl.train.batch import TrainBatch
from postrl.train.micro_batches import micro_batches
from postrl.train.replicas import Replica, RoundResult, replica_micro_batches
from postrl.train.row_skipping import split_rows, unscored_diagnostics


@dataclass
class UpdateSettings:
    epochs: int
    minibatches: int
    micro_batch_size: int
    temperature: float
    max_grad_norm: float | None
    pad_id: int
    train_policy: bool = True  # False during critic warm-up
    precision: str = "fp32"
    device: str = "cpu"  # where this replica's modules live; batches stay on the CPU
    share_prompts: bool = True  # rows of a prompt share its forward (not under FSDP2)
    # rows whose loss has no gradient run forward only, for the diagnostics, or not at all
    # when the sampler's entropies stand in for that forward (one process)
    forward_only_zero_gradient: bool = True
    replica: Replica | None = None  # this process's share of data-parallel replicas (None: all)
    micro_batch_tokens: int = 0  # most tokens per micro-batch as well (0: rows alone)


@dataclass
class Trainable:
    """What one update trains: the policy (a :class:`TokenScorer`, possibly DDP-wrapped) and
    optionally PPO's critic (a :class:`ValueScorer`), with their optimizers. With ``master``
    (``precision=bf16-master``) the policy scores with the bf16 working copy and the optimizer
    steps the float32 masters."""

    policy: nn.Module
    optimizer: torch.optim.Optimizer
    critic: nn.Module | None = None
    critic_optimizer: torch.optim.Optimizer | None = None
    master: MasterWeights | None = None

    def trained_parameters(self) -> list[nn.Parameter]:
        """The policy parameters the optimizer steps (whose gradients are clipped)."""
        module = self.master.master if self.master is not None else self.policy
        return [p for p in module.parameters() if p.requires_grad]


def minibatch_rows(rows: int, minibatches: int, generator: torch.Generator) -> list[Tensor]:
    """Split row indices into ``minibatches`` near-equal parts; shuffled when more than one."""
    order = torch.randperm(rows, generator=generator) if minibatches > 1 else torch.arange(rows)
    return [part for part in torch.tensor_split(order, minibatches) if len(part)]


def update_plan(rows: int, epochs: int, minibatches: int,
                generator: torch.Generator) -> list[Tensor]:
    """The rows of every optimizer step on a batch, in order (epochs x minibatches)."""
    return [part for _ in range(epochs) for part in minibatch_rows(rows, minibatches, generator)]


def length_sorted(rows: Tensor, batch: TrainBatch) -> Tensor:
    """``rows`` longest first, so each micro-batch pads only to its own longest sequence.
    The minibatch's loss is normalised by global counts, so the split changes no gradient."""
    lengths = [len(batch.prompt_ids[i]) + int(batch.lengths[i]) for i in rows.tolist()]
    order = sorted(range(len(lengths)), key=lambda k: -lengths[k])
    return rows[torch.tensor(order, dtype=torch.long)]


def prompt_grouped(rows: Tensor, batch: TrainBatch) -> Tensor:
    """``rows`` with those of each prompt together (longest first), the prompts in order of
    their longest row: a micro-batch then holds few whole groups, each prompt runs once, and
    a group's responses pack into few rows (``postrl/models/packing.py``): fewer tokens
    through the model than length-sorted rows, padded or packed (docs/performance.md)."""
    groups: dict[tuple[int, ...], list[int]] = {}  # in order of each group's longest row
    for i in length_sorted(rows, batch).tolist():
        groups.setdefault(tuple(batch.prompt_ids[i]), []).append(i)
    return torch.tensor([i for members in groups.values() for i in members], dtype=torch.long)


def average_rounds(rounds: list[dict[str, float]]) -> dict[str, float]:
    """Metrics of several optimizer steps: mean of each value, min/max for ratio extremes."""
    merged: dict[str, float] = {}
    for key in {k for r in rounds for k in r}:
        values = [r[key] for r in rounds if key in r]
        reduce = (min if key.endswith("/min") else
                  max if key.endswith("/max") or key.startswith("guard/") else None)
        merged[key] = reduce(values) if reduce else sum(values) / len(values)
    return merged


def round_metrics(result: RoundResult) -> dict[str, float]:
    metrics = result.diagnostics.finish()
    if result.grad_norm is not None:
        metrics["grad/norm"] = result.grad_norm
    if result.value_loss is not None:
        metrics["loss/value"] = result.value_loss
        metrics["value/clip_frac"] = result.value_clip
    if result.skipped:
        metrics["guard/skipped_updates"] = 1.0
    return metrics


def clip_gradients(parameters: list[nn.Parameter], max_norm: float) -> Tensor:
    """``torch.nn.utils.clip_grad_norm_``: the gradients' total 2-norm, and the gradients
    scaled to ``max_norm`` where it is larger. For dense float32 CPU gradients (one process,
    or DDP's), the sum of squares is one BLAS dot product per gradient and the gradients are
    scaled only when the norm exceeds ``max_norm`` (PyTorch always multiplies, by 1 at most,
    to spare an accelerator a host sync; bench/log.md). Anything else (FSDP's
    sharded gradients, other devices or dtypes) goes to PyTorch's."""
    grads = [p.grad for p in parameters if p.grad is not None]
    plain = all(type(g) is Tensor and g.device.type == "cpu" and g.layout == torch.strided
                and g.dtype == torch.float32 and g.is_contiguous() for g in grads)
    if not grads or not plain:
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm)
    squares = torch.stack([torch.dot(g.view(-1), g.view(-1)) for g in grads])
    norm = squares.sum().sqrt()
    scale = max_norm / (float(norm) + 1e-6)  # PyTorch's coefficient
    if scale < 1.0:  # False for a NaN norm: the caller skips that step
        torch._foreach_mul_(grads, scale)
    return norm


def run_updates(models: Trainable, batch: TrainBatch, recipe: Recipe, loss_cfg: PolicyLossConfig,
                settings: UpdateSettings, plan: list[Tensor]) -> list[RoundResult]:
    """One optimizer step per entry of ``plan`` (rows of ``batch``); this replica's results
    (``settings.replica``'s share)."""
    settings = dataclasses.replace(settings, replica=settings.replica or Replica())
    return [_update_round(models, batch, rows, recipe, loss_cfg, settings) for rows in plan]


def drop_gradients(models: Trainable) -> None:
    """Set every trained parameter's gradient to None (the policy's and the critic's)."""
    for optimizer in (models.optimizer, models.critic_optimizer):
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)


def _update_round(models: Trainable, batch: TrainBatch, rows: Tensor, recipe: Recipe,
                  loss_cfg: PolicyLossConfig, settings: UpdateSettings) -> RoundResult:
    """One optimizer step over ``rows``: each micro-batch's loss, normalised by the whole
    minibatch's counts, adds its gradient; then the step (:func:`_step`)."""
    replica = settings.replica
    counts = BatchCounts.of(batch.response_mask[rows])  # of the whole minibatch, all replicas
    context = RoundContext(recipe, loss_cfg, counts, settings)
    result = RoundResult(Diagnostics())
    if models.critic is not None:
        result.value_loss = result.value_clip = 0.0
    drop_gradients(models)
    micros, unscored = _micro_batches(models, batch, rows, loss_cfg, settings)
    finite: list[bool | Tensor] = [True, True]  # policy, critic; read once, at the step's end
    # one autocast region per minibatch: its cache casts each weight to bf16 once, not once
    # per micro-batch (the weights only change at the optimizer step)
    with autocast(settings.precision, torch.device(settings.device).type):
        forward_only: list[Diagnostics] = []  # summed after the trained rows', as always
        for index, (micro, weight, backward) in enumerate(micros):
            into = result if backward else RoundResult(Diagnostics())
            with replica.accumulating(last=index == len(micros) - 1):
                micro_finite = _micro_step(
                    models, context,
                    MicroBatch.of(batch, micro, settings, weight * replica.size, backward), into)
            finite = [a & b for a, b in zip(finite, micro_finite, strict=True)]
            if not backward:
                forward_only.append(into.diagnostics)
    for diagnostics in forward_only:
        result.diagnostics = result.diagnostics.merge(diagnostics)
    if len(unscored):
        result.diagnostics = result.diagnostics.merge(
            unscored_diagnostics(batch, unscored, loss_cfg, counts))
    _read_on_host(result)
    _step(models, result, finite, settings)
    return result


def _micro_batches(models: Trainable, batch: TrainBatch, rows: Tensor,
                   loss_cfg: PolicyLossConfig, settings: UpdateSettings
                   ) -> tuple[list[tuple[Tensor, float, bool]], Tensor]:
    """``([(rows, weight, backward)] of this replica's micro-batches, rows not run)``: rows
    without a gradient run forward only (for the diagnostics), first, or not at all
    (``postrl.train.row_skipping``)."""
    replica = settings.replica
    arrange = prompt_grouped if settings.share_prompts else length_sorted
    trained, scored, unscored = rows, rows[:0], rows[:0]
    if settings.forward_only_zero_gradient and settings.train_policy:
        trained, scored, unscored = split_rows(rows, batch, loss_cfg, models.critic is not None,
                                               replica.rank, replica.size)
    def split(ordered: Tensor) -> list[Tensor]:
        return micro_batches(ordered, batch, settings.micro_batch_size,
                             settings.micro_batch_tokens, settings.share_prompts)

    micros = replica_micro_batches(trained, replica.rank, replica.size, split,
                                   order=lambda share: arrange(share, batch),
                                   equal_counts=replica.forwards_must_match)
    # forward-only rows first: gradients synchronise on the last micro-batch, which must run
    # a backward (FSDP2 reduce-scatters there; after it, a gradient-free forward would leave
    # the root's sharded gradients unset, and AdamW would skip those weights)
    return [(micro, 1.0, False) for micro in split(arrange(scored, batch))
            ] + [(micro, weight, True) for micro, weight in micros], unscored


def _step(models: Trainable, result: RoundResult, finite: list[bool | Tensor],
          settings: UpdateSettings) -> None:
    """The optimizer steps, where every replica's gradients are finite (else none, and the
    step is marked skipped), after clipping the policy's gradient norm."""
    policy_finite, critic_finite = settings.replica.all_true(
        [bool(f) for f in torch.stack([torch.as_tensor(f, device=settings.device)
                                       for f in finite]).tolist()])
    if settings.train_policy:
        norm = clip_gradients(models.trained_parameters(),
                              settings.max_grad_norm or float("inf"))
        if hasattr(norm, "full_tensor"):  # FSDP2's sharded gradients: the norm is a DTensor
            norm = norm.full_tensor()
        result.grad_norm = float(norm)
        if policy_finite and torch.isfinite(norm):
            models.optimizer.step()
            # fused AdamW writes the weights without bumping their version counters: bump
            # them, so that what was kept of the old weights' values (a backend's) is stale
            torch.autograd.graph.increment_version(models.trained_parameters())
            if models.master is not None:
                models.master.refresh()
        else:  # guard: never let a NaN or inf reach the weights
            models.optimizer.zero_grad(set_to_none=True)
            result.skipped = True
    if models.critic is not None:
        if critic_finite:
            models.critic_optimizer.step()
        else:
            models.critic_optimizer.zero_grad(set_to_none=True)
            result.skipped = True


def _read_on_host(result: RoundResult) -> None:
    """The step's statistics, kept as tensors through its micro-batches, read once."""
    result.diagnostics = result.diagnostics.resolved()
    if result.value_loss is not None:
        result.value_loss, result.value_clip = (float(v) for v in (result.value_loss,
                                                                     result.value_clip))


@dataclass
class RoundContext:
    """What every micro-batch of one optimizer step shares: the recipe, its loss, the
    minibatch's global counts (the normalisers) and the update's settings."""

    recipe: Recipe
    loss_cfg: PolicyLossConfig
    counts: BatchCounts
    settings: UpdateSettings


@dataclass
class MicroBatch:
    """One micro-batch on the update's device: ``rows`` of ``batch``, their sequences and
    response mask cut to the longest response. ``scale`` is the number of replicas (DDP
    averages their gradients: this turns the average back into the sum of the shares), or 0
    for a replica's weight-0 row; without ``backward`` (rows without a gradient, policy only)
    the forward runs under ``torch.no_grad``, for the diagnostics."""

    batch: TrainBatch
    rows: Tensor
    sequences: SequenceBatch
    mask: Tensor
    scale: float
    backward: bool

    @classmethod
    def of(cls, batch: TrainBatch, rows: Tensor, settings: UpdateSettings, scale: float,
           backward: bool) -> MicroBatch:
        sequences = batch.sequences(rows, settings.pad_id).to(settings.device)
        width = sequences.input_ids.shape[1] - sequences.prompt_width
        mask = batch.response_mask[rows, :width].to(settings.device)
        return cls(batch, rows, sequences, mask, scale, backward)

    def columns(self, tensor: Tensor | None) -> Tensor | None:
        """These rows of a per-token tensor of the batch (``[N, T]``), on the device."""
        return None if tensor is None else tensor[self.rows, :self.mask.shape[1]].to(
            self.mask.device)


def _micro_step(models: Trainable, context: RoundContext, micro: MicroBatch,
                result: RoundResult) -> tuple[bool | Tensor, bool | Tensor]:
    """Forward and backward of one micro-batch, its shares added to ``result``. Returns
    whether the policy and the critic losses were finite."""
    settings, loss_cfg = context.settings, context.loss_cfg
    need_entropy_grad = micro.backward and (loss_cfg.entropy_coef > 0 or (
        loss_cfg.ratio == "hybrid" and loss_cfg.hybrid_mixing == "entropy"))
    policy_finite = critic_finite = True
    if settings.train_policy:
        with nullcontext() if micro.backward else torch.no_grad():
            diagnostics, policy_finite = _policy_micro_step(models.policy, context, micro,
                                                            need_entropy_grad)
        if micro.scale:
            result.diagnostics = result.diagnostics.merge(diagnostics)
    if models.critic is not None:  # float32 weights: autocast in either bf16 mode
        with float32_module_autocast(settings.precision, torch.device(settings.device).type):
            value, clip_share = _critic_micro_step(models.critic, context, micro)
        critic_finite = torch.isfinite(value)
        if micro.scale:
            result.value_loss += value
            result.value_clip += clip_share
    return policy_finite, critic_finite


def _policy_micro_step(policy, context: RoundContext, micro: MicroBatch,
                       need_entropy_grad: bool) -> tuple[Diagnostics, Tensor]:
    logp, entropy = policy(micro.sequences, context.settings.temperature, need_entropy_grad)
    batch = micro.batch
    old = micro.columns(batch.old_logp)
    inputs = PolicyLossInputs(logp, logp.detach() if old is None else old,
                              micro.columns(batch.advantages), micro.mask,
                              micro.columns(batch.ref_logp), entropy,
                              micro.columns(batch.sampler_logp))
    out = policy_loss(inputs, context.loss_cfg, context.counts)
    # always backward, even a non-finite loss: data-parallel replicas must all take part in
    # the gradient all-reduce; the non-finite step is then skipped by every replica
    if micro.backward:
        (out.loss * micro.scale).backward()
    return out.diagnostics, torch.isfinite(out.loss.detach())


def _critic_micro_step(critic, context: RoundContext,
                       micro: MicroBatch) -> tuple[Tensor, Tensor]:
    """PPO's clipped value loss (docs/algorithms.md §5), aggregated like the policy loss."""
    recipe, loss_cfg, counts = context.recipe, context.loss_cfg, context.counts
    values = critic(micro.sequences)
    per_token, clipped = clipped_value_loss(values, micro.columns(micro.batch.old_values),
                                            micro.columns(micro.batch.returns),
                                            recipe.value_clip)
    loss = aggregate(per_token, micro.mask, loss_cfg.aggregation, counts, loss_cfg.norm_constant)
    (recipe.vf_coef * loss * micro.scale).backward()
    clip_share = aggregate(clipped.float(), micro.mask, "token_mean", counts)
    return loss.detach().double(), clip_share.double()  # summed in float64, as floats were
