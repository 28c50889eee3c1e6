"""``postrl replay RUN_DIR --step K RECIPE...``: several recipes' losses on ONE frozen batch.

The batch ``RUN_DIR/rollouts/step_K.pt`` (saved with ``save_rollouts_every``) fixes the
prompts, responses and rewards; each recipe then contributes only what its components do to
the loss: advantages from the saved rewards, the overlong filter on the mask, the surrogate,
aggregation, KL and entropy terms, the sampler-trainer mismatch correction. For each recipe:
the loss, the per-token weights ``d loss / d logp[i,t]``, the gradient norm over the policy's
parameters, and the cosine similarity between every pair of recipes' gradients.

Components that act before the loss (dynamic sampling, overlong shaping) are the run's: the
groups were already chosen and the rewards already shaped when the batch was frozen.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from postrl.components import differing
from postrl.config import load_config
from postrl.errors import ConfigError
from postrl.experiments.compare import parse_recipe_spec
from postrl.experiments.paired import format_table
from postrl.models import load_policy
from postrl.models.logprobs import response_logprobs
from postrl.objectives import BatchCounts, Diagnostics, PolicyLossInputs, policy_loss
from postrl.recipes import Recipe
from postrl.train.batch import TrainBatch, compute_advantages, load_rollout_batch

BATCH_COMPONENTS = ("dynamic sampling", "overlong shaping")


@dataclass
class RecipeReplay:
    """One recipe on the frozen batch."""

    label: str
    loss: float
    grad_norm: float
    weights: Tensor  # [N, T] d loss / d logp, 0 off the recipe's mask
    mask: Tensor  # [N, T] the recipe's response mask (overlong filter applied)
    metrics: dict[str, float]  # the loss diagnostics (clip fractions, ratios, ...)
    gradient: Tensor  # flattened parameter gradient (float32)


@dataclass
class ReplayResult:
    step: int
    policy: str
    on_policy: bool  # old log-probs are the policy's own (nothing saved)
    saved_reference: bool  # reference log-probs came with the batch (else the policy's own)
    rows: int
    recipes: list[RecipeReplay]
    cosine: list[list[float]]
    notes: list[str]


def rollout_path(run_dir: Path, step: int) -> Path:
    """``RUN_DIR/rollouts/step_K.pt``, or a ConfigError naming the saved steps."""
    path = run_dir / "rollouts" / f"step_{step}.pt"
    if not path.is_file():
        saved = sorted(int(p.stem.split("_")[1]) for p in (run_dir / "rollouts").glob("step_*.pt"))
        hint = (f"saved steps: {', '.join(map(str, saved))}" if saved else
                "the run saved none: train with save_rollouts_every=N")
        raise ConfigError(f"no frozen batch {path} ({hint})")
    return path


def policy_spec(run_dir: Path, config: dict, model: str | None) -> str:
    """``--model``, else the run's ``final`` policy, else the model the run started from."""
    if model:
        return model
    final = run_dir / "final"
    return str(final) if (final / "config.json").is_file() else str(config["model"])


def replay_recipe_of(text: str, config: dict) -> tuple[str, Recipe]:
    """``NAME[:recipe options]`` validated against the batch's schedule."""
    spec = parse_recipe_spec(text)
    if any(not o.startswith("recipe_options.") for o in spec.overrides):
        raise ConfigError(f"replay {text!r}: only recipe options can change; the schedule is "
                          "the frozen batch's")
    cfg = load_config(None, [f"recipe={spec.preset}", *spec.overrides,
                             f"group_size={config['group_size']}",
                             f"max_new_tokens={config['max_new_tokens']}"])
    recipe = cfg.build_recipe()
    if recipe.advantage == "gae" or recipe.critic:
        raise ConfigError(f"replay {text!r}: GAE advantages need the run's critic values, which "
                          "a frozen batch does not hold; replay critic-free recipes")
    return spec.label, recipe


def recipe_mask(batch: TrainBatch, recipe: Recipe) -> Tensor:
    """All generated tokens, minus truncated responses under overlong filtering (DAPO §3.4);
    never an episode's environment tokens."""
    width = batch.response_ids.shape[1]
    mask = torch.arange(width) < batch.lengths.unsqueeze(1)
    if batch.env_mask is not None:
        mask = mask & ~batch.env_mask
    return mask & ~batch.truncated.unsqueeze(1) if recipe.overlong_filter else mask


@torch.no_grad()
def policy_logprobs(lm, batch: TrainBatch, temperature: float, chunk: int, pad_id: int) -> Tensor:
    """Per-token log-probs of the loaded policy, micro-batched like the loss."""
    width = batch.response_ids.shape[1]
    out = torch.zeros(batch.rows, width)
    for micro in torch.split(torch.arange(batch.rows), chunk):
        logp = response_logprobs(lm, batch.sequences(micro, pad_id), temperature)[0]
        out[micro, : logp.shape[1]] = logp
    return out


def replay_recipe(lm, batch: TrainBatch, label: str, recipe: Recipe, own_logp: Tensor,
                  config: dict, pad_id: int) -> RecipeReplay:
    """Loss, per-token weights and parameter gradient of one recipe on the frozen batch."""
    mask = recipe_mask(batch, recipe)
    old_logp = batch.old_logp
    ref_logp = batch.ref_logp if batch.ref_logp is not None else own_logp
    kl_in_reward = recipe.needs_reference and recipe.kl_placement == "reward"
    frozen = dataclasses.replace(batch, response_mask=mask, ref_logp=ref_logp)
    advantages, _ = compute_advantages(recipe, frozen, recipe.kl_coef if kl_in_reward else 0.0,
                                       old_logp if old_logp is not None else own_logp)
    loss_cfg = recipe.policy_loss_config(config["max_new_tokens"])
    if loss_cfg.corrects_mismatch and batch.sampler_logp is None:
        raise ConfigError(f"{label}: the mismatch correction needs the sampler's log-probs, and "
                          "this frozen batch was saved without them (before postrl kept them)")
    need_entropy_grad = loss_cfg.entropy_coef > 0 or (
        loss_cfg.ratio == "hybrid" and loss_cfg.hybrid_mixing == "entropy")
    counts = BatchCounts.of(mask)  # the GLOBAL counts: micro-batches sum to the full gradient
    lm.zero_grad(set_to_none=True)
    weights = torch.zeros(batch.rows, mask.shape[1])
    diagnostics, loss = Diagnostics(), 0.0
    for micro in torch.split(torch.arange(batch.rows), config["micro_batch_size"]):
        sequences = frozen.sequences(micro, pad_id)
        width = sequences.input_ids.shape[1] - sequences.prompt_width
        logp, entropy = response_logprobs(lm, sequences, config["temperature"], with_entropy=True,
                                          entropy_grad=need_entropy_grad)
        logp.retain_grad()
        old = old_logp[micro, :width] if old_logp is not None else logp.detach()
        ref = ref_logp[micro, :width] if recipe.needs_reference else None
        sampler = (batch.sampler_logp[micro, :width] if batch.sampler_logp is not None
                   else None)
        out = policy_loss(PolicyLossInputs(logp, old, advantages[micro, :width],
                                           mask[micro, :width], ref, entropy, sampler),
                          loss_cfg, counts)
        out.loss.backward()
        weights[micro, :width] = logp.grad * mask[micro, :width]
        diagnostics = diagnostics.merge(out.diagnostics)
        loss += float(out.loss.detach())
    gradient = torch.cat([p.grad.detach().flatten().float() if p.grad is not None
                          else torch.zeros(p.numel()) for p in lm.parameters()])
    norm = sum(float(part.double().square().sum()) for part in gradient.split(1 << 20)) ** 0.5
    return RecipeReplay(label, loss, norm, weights, mask,
                        diagnostics.finish(), gradient)


def cosine_matrix(gradients: list[Tensor], chunk: int = 1 << 20) -> list[list[float]]:
    """Cosine similarity of every pair of gradients (NaN where a gradient is zero), from their
    Gram matrix accumulated in float64 over chunks of parameters (no float64 copy of a model)."""
    gram = torch.zeros(len(gradients), len(gradients), dtype=torch.float64)
    for start in range(0, gradients[0].numel(), chunk):
        rows = torch.stack([g[start:start + chunk] for g in gradients]).double()
        gram += rows @ rows.T
    norms = gram.diagonal().sqrt()
    cosine = gram / (norms.unsqueeze(0) * norms.unsqueeze(1))
    return [[float(v) for v in row] for row in cosine]


def replay(run_dir: Path | str, step: int, recipes: list[str],
           model: str | None = None) -> ReplayResult:
    """Every recipe's loss and gradient on the frozen batch of ``step``."""
    run_dir = Path(run_dir)
    batch, config = load_rollout_batch(rollout_path(run_dir, step))
    parsed = [replay_recipe_of(text, config) for text in recipes]
    spec = policy_spec(run_dir, config, model)
    lm, tokenizer = load_policy(spec, seed=config.get("seed", 0))
    lm.eval()  # no dropout: equal components must give bit-identical gradients
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    unfiltered = dataclasses.replace(batch, response_mask=recipe_mask(batch, Recipe("all")))
    own = policy_logprobs(lm, unfiltered, config["temperature"], config["micro_batch_size"],
                          pad_id)
    results = [replay_recipe(lm, batch, label, recipe, own, config, pad_id)
               for label, recipe in parsed]
    return ReplayResult(step, spec, batch.old_logp is None, batch.ref_logp is not None,
                        batch.rows, results,
                        cosine_matrix([r.gradient for r in results]), _notes(parsed, config))


def _notes(parsed: list[tuple[str, Recipe]], config: dict) -> list[str]:
    run_recipe = Recipe(**config["resolved_recipe"])
    notes = []
    for label, recipe in parsed:
        titles = [c.title for c in differing(run_recipe, recipe) if c.title in BATCH_COMPONENTS]
        if titles:
            notes.append(f"{label}: {', '.join(titles)} differ from the run's, but the frozen "
                         "batch was built with the run's (groups chosen, rewards shaped)")
    return notes


def format_result(result: ReplayResult) -> str:
    """The table of recipes and the matrix of gradient cosines."""
    source = ("the policy's own (on-policy: every ratio is 1)" if result.on_policy
              else "saved with the batch (off-policy)")
    reference = ("saved with the batch (the run's reference)" if result.saved_reference
                 else "the policy's own (KL = 0)")
    lines = [f"step {result.step}: {result.rows} responses; policy {result.policy}",
             f"old log-probs: {source}; reference log-probs (KL recipes): {reference}"]
    rows = []
    for r in result.recipes:
        w = r.weights[r.mask].abs()
        rows.append([r.label, r.loss, r.grad_norm, float(w.mean()) if w.numel() else 0.0,
                     float(w.max()) if w.numel() else 0.0, int(r.mask.sum()),
                     r.metrics.get("clip/low_frac"), r.metrics.get("clip/high_frac")])
    lines.append(format_table(("recipe", "loss", "grad norm", "mean |w|", "max |w|", "tokens",
                               "clip low", "clip high"), rows))
    labels = [f"[{i}] {r.label}" for i, r in enumerate(result.recipes, 1)]
    columns = [f"[{i}]" for i in range(1, len(labels) + 1)]
    matrix = [[label, *(f"{v:.6f}" for v in row)]
              for label, row in zip(labels, result.cosine, strict=True)]
    lines += ["", "cosine similarity of the parameter gradients:",
              format_table(("", *columns), matrix)]
    lines += [f"note: {n}" for n in result.notes]
    return "\n".join(lines)


def result_json(result: ReplayResult) -> dict:
    """Everything but the gradients; per-token weights per response, valid tokens only."""
    recipes = [{"recipe": r.label, "loss": r.loss, "grad_norm": r.grad_norm, "metrics": r.metrics,
                "token_weights": [row[m].tolist() for row, m in zip(r.weights, r.mask,
                                                                    strict=True)]}
               for r in result.recipes]
    return {"step": result.step, "policy": result.policy, "on_policy": result.on_policy,
            "saved_reference": result.saved_reference,
            "responses": result.rows, "recipes": recipes, "cosine": result.cosine,
            "notes": result.notes}


def add_replay_arguments(parser: argparse.ArgumentParser) -> None:
    """``postrl replay RUN_DIR --step K RECIPE... [--model PATH] [--json]``."""
    parser.add_argument("run_dir", metavar="RUN_DIR")
    parser.add_argument("recipes", nargs="+", metavar="RECIPE",
                        help="a preset, optionally with component overrides: gspo:clip_high=1e-3")
    parser.add_argument("--step", type=int, required=True, help="the saved batch step_K.pt")
    parser.add_argument("--model", help="policy to evaluate (default RUN_DIR/final, else the "
                                        "run's model)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")


def run_replay(args: argparse.Namespace) -> int:
    """Entry point of ``postrl replay``."""
    result = replay(args.run_dir, args.step, args.recipes, args.model)
    print(json.dumps(result_json(result), indent=2) if args.json else format_result(result))
    return 0
