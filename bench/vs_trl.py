"""postrl against TRL's GRPOTrainer on the same CPU, side by side (`make bench`).

Same model (SmolLM2-135M-Instruct), prompts, reward, G = 8 completions of 4 prompts per step,
temperature 1, learning rate 1e-6, no KL, and the same loss: Dr. GRPO (advantage
R - mean_g R, loss sum / (N * max_new_tokens)) — postrl's `dr_grpo` recipe and TRL's
`loss_type="dr_grpo"`, `scale_rewards="none"`. One optimizer step per generation round on
both sides. The regimes (``bench/regimes.py``): ``short`` (single-digit additions, at most 64
new tokens), ``gsm8k-256`` and ``gsm8k-1024`` (GSM8K questions, at most 256 or 1,024).

Each framework runs in its own child process (so peak RSS is its own), alternating A/B per
round, for each regime and precision; the first step of a child is a warm-up and is not
counted. A child may use at most ``--memory-limit-gb`` (default 90% of this machine's memory):
a framework that needs more is reported as not fitting, and postrl's row stands alone; it is
not run at longer responses in that setting (regimes run shortest first).

    python -m bench.vs_trl [--regimes short,gsm8k-256,gsm8k-1024] [--steps N] [--rounds 2]
                           [--precisions bf16,fp32] [--gsm8k PATH]

In the bf16 setting TRL autocasts (its fastest working setting on a CPU with AMX) and postrl runs
``--postrl-bf16`` (default ``bf16-master``: a bf16 working copy over float32 master weights;
``bf16`` autocasts like TRL). Each regime ends with a line `REGIME: speedup=X.XX
rss_ratio=Y.YY` for postrl's fastest setting against TRL's (each the fastest it measured):
steps/s of postrl over TRL, and postrl's peak RSS over TRL's. On a CPU without fast bf16
matmuls (AVX2: no AVX-512 or AMX) the bf16 setting is skipped unless ``--precisions`` asks for
it: bf16 matmuls run there in generic fallback kernels, several times slower than fp32, for
both frameworks.
``--postrl-compile`` runs postrl with ``torch_compile=true``: its layers compile during the
untimed first step, whose time is printed too. postrl's rows per forward/backward
(``--micro-batch-size``) default to :data:`MICRO_BATCH`, TRL's (``--trl-micro-batch-size``,
its gradients accumulated into one step) to the regime's: all 32 in ``short``, fewer where
32 long rows do not fit (:func:`trl_batch`). Both keep every layer's activations for the
backward unless ``--gradient-checkpointing postrl,trl`` (TRL's default; or either alone) has
them recompute each layer there. ``--postrl-return-freed-memory`` runs postrl with
``reuse_freed_memory=false`` (its least memory, slower).

Both train on the same prompts at every step: TRL gets postrl's sampled order, unshuffled,
and each round's prompts are checked to be the same on both sides. Round ``r`` runs both with
seed ``r`` (prompt order and sampling), so that the rounds average over the data as well as
over the machine's drift: with one seed, every round would sample the same completions.

Beside each postrl row: ``roofline s``, the least time its step could take on this machine
(``regimes.roofline_s``: its FLOPs at the measured matmul peak and its decoding's reads at the
measured memory rate, ``bench/peaks.py``), and postrl's share of it (roofline / step time).

The table's last columns are means over each framework's timed steps of what it sampled:
the share of groups whose rewards were all equal (TRL's ``frac_reward_zero_std``), the tokens
generated per step and the mean reward (TRL's own ``completions/mean_length`` × 32 and
``reward``). postrl skips the forward and backward of groups without variance (their gradient
is exactly zero, their ratios exactly 1 in a batch used once, and the sampler recorded their
entropies, so the diagnostics still count them); TRL runs them forward and backward, so its
training phase does not depend on their share and postrl's does.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.children import peak_rss_mb, run_child
from bench.peaks import machine_limits
from bench.regimes import (
    SHORT,
    Regime,
    answer_closeness,
    as_dict,
    parse_regimes,
    reward_spec,
    step_work,
    task_spec,
)
from bench.vs_trl_args import checkpointed, parse_arguments
from bench.vs_trl_report import report, summary
from postrl.models.precision import cpu_bf16_reason

PROMPTS = 4
GROUP = 8
LR = 1e-6
MAX_NEW = SHORT.max_new_tokens  # the A/B scripts' regime

# postrl's rows per micro-batch, by precision. In bf16 the 32 rows in one micro-batch (as TRL
# runs them) took the update 0.79-0.85 of the time of two 16-row ones (alternated A/B, 2026-12-03),
# at the same peak RSS (3,990 against 3,914-3,986 MB); in fp32 they were even or slower
# (train 3.58 → 3.88 and 5.34 → 5.49 s) at 580 MB more.
MICRO_BATCH = {"fp32": 16, "bf16": 32, "bf16-master": 32}
# and at most this many tokens (micro_batch_tokens): the short regime's micro-batches hold
# fewer; at 1,024 new tokens 16 rows' activations would not fit in 24 GB (docs/performance.md)
MICRO_BATCH_TOKENS = 4096


@dataclass(frozen=True)
class Run:
    """One child's setting: the regime, the framework's own precision (postrl: fp32, bf16,
    bf16-master) and postrl's own options."""
    regime: Regime = SHORT
    precision: str = "fp32"
    micro_batch_size: int | None = None  # None: MICRO_BATCH's for the precision
    compile_layers: bool = False
    checkpointing: bool = False  # recompute each layer in the backward (TRL's default)
    reuse_freed_memory: bool = True  # postrl's reuse_freed_memory


def prompt_order(steps: int, seed: int, regime: Regime = SHORT) -> list[dict]:
    """The examples postrl's trainer takes in its first ``steps`` steps with ``seed``, in order:
    its own seeded sampler over the regime's task. TRL is given them in this order,
    unshuffled, so that both train on the same prompts at every step."""
    from postrl.tasks import load_task
    from postrl.train.sampling import PromptSampler

    task = load_task(task_spec(regime))
    sampler = PromptSampler(task.train(), seed)  # as the trainer seeds it
    return [{"question": e.question, "answer": e.columns["answer"]}
            for e in sampler.take(PROMPTS * steps)]


def postrl_config(steps: int, seed: int, precision: str = "fp32",
                  micro_batch_size: int | None = None, compile_layers: bool = False,
                  regime: Regime = SHORT):
    """postrl's run: ``steps`` steps in all, the warm-up included; ``micro_batch_size`` None:
    :data:`MICRO_BATCH`'s for ``precision``."""
    from postrl.config import load_config

    micro_batch_size = micro_batch_size or MICRO_BATCH[precision]
    return load_config(None, [
        "model=smollm2-135m-instruct", "recipe=dr_grpo", f"task={task_spec(regime)}",
        f"rewards=[{reward_spec(regime)}]", f"lr={LR}", f"prompts_per_step={PROMPTS}",
        f"group_size={GROUP}", f"max_new_tokens={regime.max_new_tokens}",
        f"precision={precision}", f"out={tempfile.mkdtemp()}/run", "quiet=true",
        f"steps={steps}", f"seed={seed}", f"micro_batch_size={micro_batch_size}",
        f"micro_batch_tokens={MICRO_BATCH_TOKENS}",
        f"torch_compile={str(compile_layers).lower()}"])


def record_prompts(trainer) -> list[list[str]]:
    """The questions ``trainer``'s sampler hands out from now on, one list per call (a step)."""
    prompts = []
    take = trainer.sampler.take

    def recorded(count):
        batch = take(count)
        prompts.append([e.question for e in batch])
        return batch

    trainer.sampler.take = recorded
    return prompts


def record_work(trainer) -> list[dict]:
    """What each of ``trainer``'s steps from now on had to compute (``regimes.StepWork``)."""
    works = []
    update = trainer.phases.update

    def recorded(batch):
        metrics = update(batch)
        works.append(as_dict(step_work(trainer, batch)))
        return metrics

    trainer.phases.update = recorded
    return works


def run_postrl(steps: int, seed: int, run: Run) -> dict:
    from postrl.train.trainer import Trainer

    config = postrl_config(steps + 1, seed, run.precision, run.micro_batch_size,
                           run.compile_layers, run.regime)
    config.gradient_checkpointing = run.checkpointing
    config.reuse_freed_memory = run.reuse_freed_memory
    trainer = Trainer(config)
    prompts, works = record_prompts(trainer), record_work(trainer)
    warmup, *rows = [trainer.train_step() for _ in range(steps + 1)]
    return {"warmup_s": [warmup["time/step_s"]], "step_s": [r["time/step_s"] for r in rows],
            "generate_s": [r["time/generate_s"] + r["time/score_s"] for r in rows],
            "train_s": [r["time/train_s"] + r["time/reference_s"] for r in rows],
            "tokens": [r["length/mean"] * PROMPTS * GROUP for r in rows],
            "zero_variance": [r["batch/zero_variance_frac"] for r in rows],
            "reward": [r["reward/mean"] for r in rows], "prompts": prompts,
            "work": works[1:]}


def trl_batch(run: Run) -> dict[str, int]:
    """TRL's batch options: a step's 32 rows in micro-batches of the regime's
    ``trl_micro_batch`` rows, their gradients accumulated into one optimizer step. TRL then
    generates all 32 at once (its generation batch is the micro-batch times the accumulation
    steps), uses them once, and divides each micro-batch's Dr. GRPO loss, sum / (rows *
    max_completion_length), by the accumulation steps: the loss of all 32 rows at once."""
    rows = run.regime.trl_micro_batch
    return {"per_device_train_batch_size": rows,
            "gradient_accumulation_steps": PROMPTS * GROUP // rows}


def run_trl(steps: int, seed: int, run: Run) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from postrl.models.loading import smollm2_dir
    from postrl.rewards import math_answer

    rows = prompt_order(steps + 1, seed, run.regime)
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": r["question"]}],
                                  "answer": r["answer"]} for r in rows])
    path = str(smollm2_dir())
    model = AutoModelForCausalLM.from_pretrained(path, dtype="float32")
    tokenizer = AutoTokenizer.from_pretrained(path)
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(), **trl_batch(run), num_generations=GROUP,
        max_completion_length=run.regime.max_new_tokens,
        learning_rate=LR, beta=0.0, loss_type="dr_grpo", scale_rewards="none", temperature=1.0,
        use_cpu=True, bf16=run.precision == "bf16", gradient_checkpointing=run.checkpointing,
        max_steps=steps + 1, logging_steps=1, report_to=[], save_strategy="no", seed=seed,
        dataloader_num_workers=0, disable_tqdm=True, shuffle_dataset=False)
    reward = math_answer if run.regime.reward == "math_answer" else answer_closeness
    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=args,
                          train_dataset=dataset, processing_class=tokenizer)
    phases = {"generate": [], "loss_forward": [], "step": []}
    # TRL's own per-step logs: frac_reward_zero_std, mean reward, mean completion length
    logged = {"frac_reward_zero_std": [], "reward": [], "completions/mean_length": []}
    prompts = []  # the questions of each step's generation round

    def timed(name, function):
        def wrapper(*a, **k):
            start = time.perf_counter()
            try:
                return function(*a, **k)
            finally:
                phases[name][-1] += time.perf_counter() - start
        return wrapper

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.start = time.perf_counter()
            for name in phases:
                phases[name].append(0.0)

        def on_step_end(self, *a, **k):
            phases["step"][-1] = time.perf_counter() - self.start

        def on_log(self, args, state, control, logs=None, **k):
            for key, values in logged.items():
                if logs and key in logs:
                    values.append(logs[key])

    generate = timed("generate", trainer._generate_and_score_completions)

    def recorded(inputs):  # G rows per prompt, adjacent
        prompts.append([row["prompt"][-1]["content"] for row in inputs[::GROUP]])
        return generate(inputs)

    trainer._generate_and_score_completions = recorded
    trainer.compute_loss = timed("loss_forward", trainer.compute_loss)
    trainer.add_callback(Clock())
    trainer.train()
    steps_s = phases["step"][1:]
    return {"step_s": steps_s, "generate_s": phases["generate"][1:],
            "train_s": [s - g for s, g in zip(steps_s, phases["generate"][1:], strict=True)],
            "loss_forward_s": phases["loss_forward"][1:],
            "zero_variance": logged["frac_reward_zero_std"][1:], "reward": logged["reward"][1:],
            "tokens": [n * PROMPTS * GROUP for n in logged["completions/mean_length"][1:]],
            "prompts": prompts}


def child(framework: str, steps: int, seed: int, run: Run) -> None:
    import torch

    torch.manual_seed(seed)
    result = run_postrl(steps, seed, run) if framework == "postrl" else run_trl(steps, seed, run)
    result["peak_rss_mb"] = peak_rss_mb()
    print("RESULT " + json.dumps(result), flush=True)


def spawn(framework: str, steps: int, seed: int, run: Run, limit_gb: float) -> dict:
    """One child run; ``{"failed": why}`` when it ran out of memory."""
    return run_child(["bench.vs_trl", "--child", framework, "--steps", str(steps),
                      "--seed", str(seed), "--regimes", run.regime.name,
                      *(["--gsm8k", str(run.regime.data)] if run.regime.data else []),
                      *(["--micro-batch-size", str(run.micro_batch_size)]
                        if run.micro_batch_size else []),
                      "--trl-micro-batch-size", str(run.regime.trl_micro_batch),
                      "--precisions", run.precision,
                      *(["--postrl-compile"] if run.compile_layers else []),
                      *(["--gradient-checkpointing", framework] if run.checkpointing else []),
                      *([] if run.reuse_freed_memory else ["--postrl-return-freed-memory"])],
                     limit_gb, f"{framework} ({run.regime.name}, {run.precision})")


def check_same_prompts(ours: dict, theirs: dict, round_index: int) -> None:
    """postrl and TRL trained on the same prompts at every step of a round."""
    mine, other = ours["prompts"], theirs["prompts"]
    if mine != other:
        step = next((i for i in range(min(len(mine), len(other))) if mine[i] != other[i]),
                    min(len(mine), len(other)))
        raise SystemExit(f"round {round_index + 1}: TRL trained on other prompts than postrl at "
                         f"step {step}: {other[step:step + 1]} against {mine[step:step + 1]}; "
                         "the comparison would not be fair")


def own(framework: str, setting: str, postrl_bf16: str) -> str:
    """The precision ``framework`` runs in the ``setting`` (fp32 or bf16) of the table."""
    return postrl_bf16 if framework == "postrl" and setting == "bf16" else setting


def not_to_run(out_of_memory_at: dict[tuple[str, str], int], setting: str,
               max_new_tokens: int) -> dict[str, str]:
    """``{framework: why}`` for the frameworks that ran out of memory in ``setting`` at
    ``max_new_tokens`` or fewer (``out_of_memory_at[framework, setting]``: the fewest)."""
    return {f: f"it ran out of memory at {tokens} new tokens"
            for (f, s), tokens in out_of_memory_at.items()
            if s == setting and max_new_tokens >= tokens}


def compare(regime: Regime, precision: str, args, skipped: dict[str, str]
            ) -> dict[str, list[dict]]:
    """Both frameworks' runs of one regime in one setting, alternated over the rounds; a
    framework that ran out of memory is not run again, nor one ``skipped`` names (framework:
    why)."""
    runs: dict[str, list[dict]] = {f: [{"failed": skipped[f]}] if f in skipped else []
                                   for f in ("postrl", "trl")}
    for round_index in range(args.rounds):
        order = ("postrl", "trl") if round_index % 2 == 0 else ("trl", "postrl")
        for framework in order:
            if runs[framework] and "failed" in runs[framework][-1]:
                continue
            run = Run(regime, own(framework, precision, args.postrl_bf16), args.micro_batch_size,
                      args.postrl_compile, framework in checkpointed(args),
                      framework != "postrl" or not args.postrl_return_freed_memory)
            # round r runs seed r: other prompts and samples in each round, the same prompts
            # for both frameworks
            runs[framework].append(spawn(framework, args.steps or regime.steps, round_index,
                                         run, args.memory_limit_gb))
            print(f"  {regime.name} {precision} round {round_index + 1}: {framework} done",
                  flush=True)
        if not any("failed" in r[-1] for r in runs.values()):
            check_same_prompts(runs["postrl"][-1], runs["trl"][-1], round_index)
    return runs


def regimes(args) -> list[Regime]:
    """The regimes ``args`` names, TRL's micro-batches resized by ``--trl-micro-batch-size``;
    SystemExit for a size that does not divide a step's rows."""
    chosen = parse_regimes(args.regimes, Path(args.gsm8k))
    rows = args.trl_micro_batch_size
    if rows is None:
        return chosen
    if rows < 1 or (PROMPTS * GROUP) % rows:
        raise SystemExit(f"--trl-micro-batch-size {rows}: must divide a step's "
                         f"{PROMPTS * GROUP} rows")
    return [dataclasses.replace(r, trl_micro_batch=rows) for r in chosen]


def main() -> None:
    args = parse_arguments(__doc__.splitlines()[0], MICRO_BATCH_TOKENS)
    checkpointing = checkpointed(args)  # a wrong name: before any run
    if args.child:
        child(args.child, args.steps, args.seed,
              Run(regimes(args)[0], args.precisions, args.micro_batch_size,
                  args.postrl_compile, args.child in checkpointing,
                  not args.postrl_return_freed_memory))
        return
    chosen = regimes(args)  # a missing file or a wrong size: before any run
    if args.precisions is None:
        slow = cpu_bf16_reason()
        args.precisions = "fp32" if slow else "fp32,bf16"
        if slow:
            print(f"bf16 setting skipped: {slow}", flush=True)
    settings = args.precisions.split(",")
    if checkpointing:
        print("recompute each layer in the backward (gradient checkpointing): "
              + ", ".join(sorted(checkpointing)), flush=True)
    peaks, bandwidth = machine_limits(settings)
    # a framework out of memory at some length is not run at longer ones (in the same setting):
    # TRL's generation alone would take many minutes there before it failed again
    out_of_memory_at: dict[tuple[str, str], int] = {}
    for regime in sorted(chosen, key=lambda r: r.max_new_tokens):
        table = {}
        for p in settings:
            skipped = not_to_run(out_of_memory_at, p, regime.max_new_tokens)
            runs = compare(regime, p, args, skipped)
            for f, results in runs.items():
                if f not in skipped and any("failed" in r for r in results):
                    out_of_memory_at[f, p] = regime.max_new_tokens
            table[p] = {f: summary(r, peaks[p], bandwidth) for f, r in runs.items()}
        report(regime, table, lambda f, p: own(f, p, args.postrl_bf16))


if __name__ == "__main__":
    main()
