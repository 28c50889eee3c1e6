"""postrl's one pass of prompts and packed responses through each layer, against two passes
(the prompts through every layer first, then the responses after their keys and values),
alternated in one process on the same batches.

    python bench/prompt_pass_ab.py layers [--model tiny] [--rows 8] [--reps 100]
    python bench/prompt_pass_ab.py recipes [--steps 12]

``layers``: the decoder layers' forward and backward alone (``response_hidden``) on a batch
of ``rows`` responses, 8 per prompt. ``recipes``: every recipe on the tiny model (the
``bench/recipe_steps.py`` config); each step's reference/old-policy forwards and update run
both ways from the same weights and optimizer state, in alternating order.

Whole runs before and after a change, even alternated, differ by 10-20% from process to
process on a shared VM with identical code (docs/performance.md); one process and the same
batch both ways takes that noise out.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import postrl.models.logprobs as lp

ONE_PASS = lp._OwnLayers.forward_with_prompts


def two_passes(self, prompt_ids, prompt_positions, prompt_mask, packing, bias, eager=False):
    """The prompts' forward (keeping their keys and values), then the packed responses'
    (this bench's batches have no sampler record, which would make the layers ``eager``)."""
    assert not eager
    prompt, past = self.forward(prompt_ids, prompt_positions, prompt_mask, keep=True)
    packed, _ = self.forward(packing.input_ids, packing.position_ids, bias,
                             self.select(past, packing.prompts))
    return prompt, packed


def use(one_pass: bool) -> None:
    lp._OwnLayers.forward_with_prompts = ONE_PASS if one_pass else two_passes


def alternate(run, reps: int) -> dict[bool, float]:
    """Median seconds of ``run()`` under each way, over ``reps`` alternations but the first two."""
    times: dict[bool, list[float]] = {True: [], False: []}
    for i in range(reps):
        for one_pass in ((True, False) if i % 2 else (False, True)):
            use(one_pass)
            start = time.perf_counter()
            run()
            times[one_pass].append(time.perf_counter() - start)
    use(True)
    return {way: statistics.median(t[2:]) for way, t in times.items()}


def layers(model_spec: str, rows: int, reps: int) -> None:
    from postrl.models.loading import load_policy
    from postrl.process import configure_process

    configure_process(None, reuse_freed_memory=True)
    torch.manual_seed(0)
    model, _ = load_policy(model_spec)
    group = 8
    distinct = [torch.randint(0, 40000, (45 + 7 * j,)).tolist() for j in range(-(-rows // group))]
    lengths = torch.randint(8, 33, (rows,))
    mask = (torch.arange(32)[None] < lengths[:, None]).long()
    batch = lp.SequenceBatch.build([distinct[i // group] for i in range(rows)],
                                   torch.randint(0, 40000, (rows, 32)) * mask, mask, 0)

    def run():
        lp.response_hidden(model, batch)[0].sum().backward()
        model.zero_grad(set_to_none=True)

    t = alternate(run, reps)
    print(f"{model_spec}, {rows} rows: two passes {t[False] * 1e3:.1f} ms, "
          f"one pass {t[True] * 1e3:.1f} ms, ratio {t[True] / t[False]:.3f}")


def recipes(steps: int) -> None:
    from ab import alternating, from_one_state  # bench/, this script's directory
    from recipe_steps import recipe_config, recipe_names

    from postrl.train.trainer import Trainer

    print(f"{'recipe':<24}{'two passes s':>14}{'one pass s':>12}{'ratio':>7}")
    for name in recipe_names():
        trainer = Trainer(recipe_config(name, steps))
        prepare, update = trainer.phases.prepare, trainer.phases.update
        times: dict[bool, list[float]] = {True: [], False: []}

        def both_ways(batch, trainer=trainer, prepare=prepare, update=update, times=times):
            def run(one_pass):
                use(one_pass)
                prepare(batch)
                return update(batch)

            ways = alternating(2, flip=trainer.step % 2 == 1)
            step_times, metrics = from_one_state(trainer, run, ways)
            use(True)
            for way, seconds in step_times.items():
                times[way] += seconds
            return metrics  # the last run's: both ways give the same, up to float rounding

        trainer.phases.prepare, trainer.phases.update = (lambda batch: None), both_ways
        for _ in range(steps):
            trainer.train_step()
        two, one = (statistics.median(times[way][2:]) for way in (False, True))
        print(f"{name:<24}{two:14.4f}{one:12.4f}{one / two:7.3f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("layers", "recipes"))
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--reps", type=int, default=100)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    if args.what == "layers":
        layers(args.model, args.rows, args.reps)
    else:
        recipes(args.steps)


if __name__ == "__main__":
    main()
