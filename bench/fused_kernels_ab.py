"""The update with the training forward's fused kernels against PyTorch's operations,
alternated in one process from the same weights and optimizer state.

    python bench/fused_kernels_ab.py --part norm_mlp|vocab|attention|rotate|all
                                            |tiles|tile_attention|tile_groups
                                     [--steps 3] [--reps 5] [--precision fp32|bf16-master]
                                     [--multiply] [--regime short|gsm8k-256|gsm8k-1024]

``norm_mlp``: RMSNorm and SiLU(gate) * up (``postrl/accel/csrc/fused.c``); ``vocab``: the
log-probability and entropy over the vocabulary (``postrl/accel/csrc/vocab.c``); ``attention``:
the attention's scaled, biased softmax (``fused.c``); ``rotate``: the rotary embedding of
queries and keys (``fused.c``); ``all``: the four; ``tiles``: everything the update runs on
AMX tiles (``postrl/accel/tiles.py``, so bf16 only: the linears' gradients, and with them the
two parts that follow, which ask ``tiles.kernels`` too);
``tile_attention``: the attention's forward and backward on AMX tiles, one kernel each
(``postrl/accel/tile_attention.py``, bf16 only; off: the fused softmax between PyTorch's
``bmm``s); ``tile_groups``: one backward for the linears that read the same input, their
input gradients summed in float32 on the tiles (``tiles.linears``; off: autograd adds each
linear's). ``bench/vs_trl.py``'s
postrl run (SmolLM2, 4 prompts x 8, 64 new tokens, reading the sampler's record); the last
step's update runs ``reps`` times each way (ABBA order, after an untimed warm-up), and the
line gives the medians and their ratio. The steps before it train with the kernels on.
``--multiply``: the update multiplies its own forward (``reuse_sampler_forward=false``).
``--regime``: ``bench/regimes.py``'s (GSM8K at 256 or 1,024 new tokens, where the sampler's
record may not fit in its share of the memory: the line says whether the update read it).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from pathlib import Path

from postrl.accel import fused, tile_attention, tiles, vocab
from postrl.accel.recorded import parameter_versions
from postrl.models import ops

PARTS = ("norm_mlp", "vocab", "attention", "rotate")  # "all"; the tiles' parts alone


def switches(parts: tuple[str, ...]):
    """``switch(on)``: ``parts``' kernels on, or PyTorch's operations in their place."""
    kept = {"rms_norm": fused.rms_norm, "swiglu": fused.swiglu, "rotate": fused.rotate,
            "fuses_attention": fused.fuses_attention, "vocab": vocab.serves,
            "tiles": tiles.kernels, "tile_attention": tile_attention.serves,
            "tile_groups": tiles.serves_together}
    off = {"rms_norm": ops.rms_norm, "swiglu": ops.swiglu,
           "rotate": ops.rotate, "fuses_attention": lambda *args: False,
           "vocab": lambda *tensors: False,
           "tiles": lambda *tensors: None, "tile_attention": lambda *tensors: False,
           "tile_groups": lambda *tensors: False}
    names = {"norm_mlp": ("rms_norm", "swiglu"), "attention": ("fuses_attention",),
             "vocab": ("vocab",), "rotate": ("rotate",), "tiles": ("tiles",),
             "tile_attention": ("tile_attention",), "tile_groups": ("tile_groups",)}

    def switch(on: bool) -> None:
        for part in parts:
            for name in names[part]:
                value = (kept if on else off)[name]
                if name == "vocab":
                    vocab.serves = value
                elif name == "tiles":
                    tiles.kernels = value
                elif name == "tile_attention":
                    tile_attention.serves = value
                elif name == "tile_groups":
                    tiles.serves_together = value
                else:
                    setattr(fused, name, value)
    return switch


def main() -> None:
    from ab import alternating, from_one_state  # bench/, this script's directory
    from regimes import GSM8K, parse_regimes
    from vs_trl import postrl_config

    from postrl.accel.native import native_kernels, unavailable_reason
    from postrl.train.trainer import Trainer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", required=True, choices=(*PARTS, "all", "tiles", "tile_attention",
                                                    "tile_groups"))
    parser.add_argument("--steps", type=int, default=3, help="steps, the last one timed")
    parser.add_argument("--reps", type=int, default=5, help="updates each way")
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16-master"))
    parser.add_argument("--multiply", action="store_true",
                        help="the update multiplies its forward (no record of the sampler's)")
    parser.add_argument("--regime", default="short", help="bench/regimes.py's regime")
    parser.add_argument("--gsm8k", default=str(GSM8K), help="GSM8K's train.jsonl")
    args = parser.parse_args()
    if native_kernels() is None:
        raise SystemExit(f"the native kernels are not available here: {unavailable_reason()}")
    switch = switches(PARTS if args.part == "all" else (args.part,))
    regime = parse_regimes(args.regime, Path(args.gsm8k))[0]
    config = postrl_config(args.steps, seed=0, precision=args.precision, regime=regime)
    trainer = Trainer(dataclasses.replace(config, reuse_sampler_forward=not args.multiply))
    original = trainer.phases.update

    def both_ways(batch):
        if trainer.step < args.steps - 1:
            return original(batch)

        def run(on):
            if batch.kept_rows is not None:  # the same weights as recorded: read it again
                batch.kept_rows.record.versions = parameter_versions(trainer.scoring_lm)
            switch(on is not False)
            try:
                return original(batch)
            finally:
                switch(True)

        times, metrics = from_one_state(trainer, run, [None, *alternating(args.reps)])
        without, fused_ = (statistics.median(times[way]) for way in (False, True))
        forward = "multiplying its forward" if batch.kept_rows is None else "reading the record"
        print(f"update ({args.regime}, {args.precision}, {forward}), {args.part}, "
              f"{int(batch.lengths.sum())} tokens, "
              f"medians of {args.reps} each way: PyTorch's {without:.3f} s, fused "
              f"{fused_:.3f} s ({fused_ / without:.3f})")
        return metrics

    trainer.phases.update = both_ways
    for _ in range(args.steps):
        trainer.train_step()


if __name__ == "__main__":
    main()
