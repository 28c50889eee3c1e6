"""postrl against TRL's GRPOTrainer on the same CPU, side by side (`make bench`).

Same model (SmolLM2-135M-Instruct), prompts (single-digit additions), G = 8 completions of
4 prompts per step, at most 64 new tokens, temperature 1, learning rate 1e-6, no KL, and the
same loss: Dr. GRPO (advantage R - mean_g R, loss sum / (N * max_new_tokens)) — postrl's
`dr_grpo` recipe and TRL's `loss_type="dr_grpo"`, `scale_rewards="none"`. One optimizer step
per generation round on both sides.

Each framework runs in its own child process (so peak RSS is its own), alternating A/B per
round, for each precision; the first step of a child is a warm-up and is not counted.

    python bench/vs_trl.py [--steps 3] [--rounds 2] [--precisions bf16,fp32]

In the bf16 setting TRL autocasts (its fastest working setting on a CPU with AMX) and postrl runs
``--postrl-bf16`` (default ``bf16-master``: a bf16 working copy over float32 master weights;
``bf16`` autocasts like TRL). The last line is `speedup=X.XX rss_ratio=Y.YY` for postrl's
fastest setting against TRL's (each the fastest it measured): steps/s of postrl over TRL, and
postrl's peak RSS over TRL's. On a CPU without fast bf16 matmuls (AVX2: no AVX-512 or AMX) the
bf16 setting is skipped unless ``--precisions`` asks for it: bf16 matmuls run there in generic
fallback kernels, several times slower than fp32, for both frameworks.
``--postrl-compile`` runs postrl with ``torch_compile=true``: its layers compile during the
untimed first step, whose time is printed too. postrl's rows per forward/backward
(``--micro-batch-size``; TRL scores all 32 at once) default to :data:`MICRO_BATCH`.

Both train on the same prompts at every step: TRL gets postrl's sampled order, unshuffled,
and each round's prompts are checked to be the same on both sides. Round ``r`` runs both with
seed ``r`` (prompt order and sampling), so that the rounds average over the data as well as
over the machine's drift: with one seed, every round would sample the same completions.

The table's last three columns are means over each framework's timed steps of what it sampled:
the share of groups whose rewards were all equal (TRL's ``frac_reward_zero_std``), the tokens
generated per step and the mean reward (TRL's own ``completions/mean_length`` × 32 and
``reward``). postrl skips the forward and backward of groups without variance (their gradient
is exactly zero, their ratios exactly 1 in a batch used once, and the sampler recorded their
entropies, so the diagnostics still count them); TRL runs them forward and backward, so its
training phase does not depend on their share and postrl's does.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time

from postrl.models.precision import cpu_bf16_reason

PROMPTS = 4
GROUP = 8
MAX_NEW = 64
LR = 1e-6


def prompt_order(steps: int, seed: int) -> list[dict]:
    """The examples postrl's trainer takes in its first ``steps`` steps with ``seed``, in order:
    its own seeded sampler over the arithmetic task (single-digit additions). TRL is given them
    in this order, unshuffled, so that both train on the same prompts at every step."""
    from postrl.tasks import load_task
    from postrl.train.sampling import PromptSampler

    sampler = PromptSampler(load_task("arithmetic").train(), seed)  # as the trainer seeds it
    return [{"question": e.question, "answer": e.columns["answer"]}
            for e in sampler.take(PROMPTS * steps)]


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# postrl's rows per micro-batch, by precision. In bf16 the 32 rows in one micro-batch (as TRL
# runs them) took the update 0.79-0.85 of the time of two 16-row ones (alternated A/B, 2026-12-03),
# at the same peak RSS (3,990 against 3,914-3,986 MB); in fp32 they were even or slower
# (train 3.58 → 3.88 and 5.34 → 5.49 s) at 580 MB more.
MICRO_BATCH = {"fp32": 16, "bf16": 32, "bf16-master": 32}


def postrl_config(steps: int, seed: int, precision: str = "fp32",
                  micro_batch_size: int | None = None, compile_layers: bool = False):
    """postrl's run: ``steps`` steps in all, the warm-up included; ``micro_batch_size`` None:
    :data:`MICRO_BATCH`'s for ``precision``."""
    from postrl.config import load_config

    micro_batch_size = micro_batch_size or MICRO_BATCH[precision]

    return load_config(None, [
        "model=smollm2-135m-instruct", "recipe=dr_grpo", "task=arithmetic", f"lr={LR}",
        f"prompts_per_step={PROMPTS}", f"group_size={GROUP}", f"max_new_tokens={MAX_NEW}",
        f"precision={precision}", f"out={tempfile.mkdtemp()}/run", "quiet=true",
        f"steps={steps}", f"seed={seed}", f"micro_batch_size={micro_batch_size}",
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


def run_postrl(steps: int, seed: int, precision: str, micro_batch_size: int | None,
               compile_layers: bool) -> dict:
    from postrl.train.trainer import Trainer

    trainer = Trainer(postrl_config(steps + 1, seed, precision, micro_batch_size,
                                    compile_layers))
    prompts = record_prompts(trainer)
    warmup, *rows = [trainer.train_step() for _ in range(steps + 1)]
    return {"warmup_s": [warmup["time/step_s"]], "step_s": [r["time/step_s"] for r in rows],
            "generate_s": [r["time/generate_s"] + r["time/score_s"] for r in rows],
            "train_s": [r["time/train_s"] + r["time/reference_s"] for r in rows],
            "tokens": [r["length/mean"] * PROMPTS * GROUP for r in rows],
            "zero_variance": [r["batch/zero_variance_frac"] for r in rows],
            "reward": [r["reward/mean"] for r in rows], "prompts": prompts}


def run_trl(steps: int, seed: int, precision: str) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from postrl.models.loading import smollm2_dir
    from postrl.rewards import math_answer

    rows = prompt_order(steps + 1, seed)
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": r["question"]}],
                                  "answer": r["answer"]} for r in rows])
    path = str(smollm2_dir())
    model = AutoModelForCausalLM.from_pretrained(path, dtype="float32")
    tokenizer = AutoTokenizer.from_pretrained(path)
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=PROMPTS * GROUP,
        num_generations=GROUP, gradient_accumulation_steps=1, max_completion_length=MAX_NEW,
        learning_rate=LR, beta=0.0, loss_type="dr_grpo", scale_rewards="none", temperature=1.0,
        use_cpu=True, bf16=precision == "bf16", gradient_checkpointing=False,
        max_steps=steps + 1, logging_steps=1, report_to=[], save_strategy="no", seed=seed,
        dataloader_num_workers=0, disable_tqdm=True, shuffle_dataset=False)
    trainer = GRPOTrainer(model=model, reward_funcs=[math_answer], args=args,
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


def child(framework: str, steps: int, seed: int, precision: str, micro_batch_size: int | None,
          compile_layers: bool) -> None:
    import torch

    torch.manual_seed(seed)
    result = (run_postrl(steps, seed, precision, micro_batch_size, compile_layers)
              if framework == "postrl"
              else run_trl(steps, seed, precision))
    result["peak_rss_mb"] = peak_rss_mb()
    print("RESULT " + json.dumps(result), flush=True)


def spawn(framework: str, steps: int, seed: int, precision: str, micro_batch_size: int | None,
          compile_layers: bool) -> dict:
    """One child run; ``precision`` is the framework's own (postrl: fp32, bf16, bf16-master)."""
    out = subprocess.run([sys.executable, __file__, "--child", framework, "--steps", str(steps),
                          "--seed", str(seed),
                          *(["--micro-batch-size", str(micro_batch_size)]
                            if micro_batch_size else []),
                          "--precisions", precision,
                          *(["--postrl-compile"] if compile_layers else [])],
                         capture_output=True, text=True)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode or not lines:
        raise SystemExit(f"{framework} ({precision}) failed:\n{out.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def summary(results: list[dict]) -> dict:
    merged = {k: [v for r in results for v in r.get(k, [])]
              for k in ("step_s", "generate_s", "train_s", "loss_forward_s", "warmup_s")}
    out = {k: statistics.median(v) for k, v in merged.items() if v}
    for key in ("zero_variance", "reward", "tokens"):  # what each side sampled: means
        values = [v for r in results for v in r.get(key, [])]
        out[key] = statistics.mean(values) if values else float("nan")
    out["peak_rss_mb"] = max(r["peak_rss_mb"] for r in results)
    return out


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="timed steps per child")
    parser.add_argument("--rounds", type=int, default=2, help="A/B alternations per precision")
    parser.add_argument("--precisions", default=None,
                        help="settings to run (default fp32,bf16; fp32 alone on a CPU without "
                             "fast bf16 matmuls, where bf16 is no one's fastest setting)")
    parser.add_argument("--micro-batch-size", type=int, default=None,
                        help="postrl's rows per forward/backward (TRL scores all 32 at once; "
                             "default: 16 in fp32, 32 in bf16)")
    parser.add_argument("--postrl-bf16", default="bf16-master", choices=("bf16", "bf16-master"),
                        help="postrl's precision in the bf16 setting (TRL autocasts)")
    parser.add_argument("--postrl-compile", action="store_true",
                        help="postrl with torch_compile=true (compiled in its untimed first step)")
    parser.add_argument("--child", choices=("postrl", "trl"))
    parser.add_argument("--seed", type=int, default=0,
                        help="a child's seed: its prompts' order and its sampling (round r: r)")
    args = parser.parse_args()
    if args.child:
        child(args.child, args.steps, args.seed, args.precisions, args.micro_batch_size,
              args.postrl_compile)
        return
    if args.precisions is None:
        slow = cpu_bf16_reason()
        args.precisions = "fp32" if slow else "fp32,bf16"
        if slow:
            print(f"bf16 setting skipped: {slow}", flush=True)
    table = {}
    for precision in args.precisions.split(","):
        runs = {"postrl": [], "trl": []}
        for round_index in range(args.rounds):
            order = ("postrl", "trl") if round_index % 2 == 0 else ("trl", "postrl")
            for framework in order:
                # round r runs seed r: other prompts and samples in each round, the same
                # prompts for both frameworks
                runs[framework].append(spawn(framework, args.steps, round_index,
                                             own(framework, precision, args.postrl_bf16),
                                             args.micro_batch_size, args.postrl_compile))
                print(f"  {precision} round {round_index + 1}: {framework} done", flush=True)
            check_same_prompts(runs["postrl"][-1], runs["trl"][-1], round_index)
        table[precision] = {f: summary(r) for f, r in runs.items()}
    print(f"\n{'setting':<19}{'step s':>9}{'generate s':>12}{'train s':>9}{'peak RSS MB':>13}"
          f"{'zero-var groups':>17}{'tokens/step':>13}{'reward':>8}")
    for precision, frameworks in table.items():
        for framework, s in frameworks.items():
            setting = f"{framework} {own(framework, precision, args.postrl_bf16)}"
            print(f"{setting:<19}{s['step_s']:>9.2f}{s['generate_s']:>12.2f}"
                  f"{s['train_s']:>9.2f}{s['peak_rss_mb']:>13.0f}{s['zero_variance']:>17.2f}"
                  f"{s['tokens']:>13.0f}{s['reward']:>8.3f}")
    for precision, f in table.items():
        print(f"postrl {own('postrl', precision, args.postrl_bf16)} first (untimed) step: "
              f"{f['postrl']['warmup_s']:.1f} s")
    for precision, f in table.items():
        speedup = f["trl"]["step_s"] / f["postrl"]["step_s"]
        rss = f["postrl"]["peak_rss_mb"] / f["trl"]["peak_rss_mb"]
        mine = own("postrl", precision, args.postrl_bf16)
        print(f"postrl {mine} vs TRL {precision}: speedup={speedup:.2f} rss_ratio={rss:.2f}")
    # each framework's fastest measured setting: TRL's is bf16 autocast on a CPU with AMX,
    # fp32 where bf16 matmuls run in fallback kernels
    theirs_best = min(table, key=lambda p: table[p]["trl"]["step_s"])
    ours = min(table, key=lambda p: table[p]["postrl"]["step_s"])
    theirs, mine = table[theirs_best]["trl"], table[ours]["postrl"]
    print(f"speedup={theirs['step_s'] / mine['step_s']:.2f} "
          f"rss_ratio={mine['peak_rss_mb'] / theirs['peak_rss_mb']:.2f}")


if __name__ == "__main__":
    main()
