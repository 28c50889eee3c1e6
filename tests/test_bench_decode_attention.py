"""bench/decode_attention_ab.py times the lean decoder fed responses the engine sampled; its
teacher-forced loop must make the engine's decode steps (the same running rows, dropped at
the same steps) and reproduce the engine's log-probs, or it would time other work."""

import torch

from postrl.accel import lean as lean_module
from postrl.rollout import HFRolloutEngine, SamplingParams
from tests.bench_scripts import load_bench_script


def test_teacher_forced_decoding_makes_the_engines_steps(tiny, monkeypatch):
    bench = load_bench_script("decode_attention_ab")
    model, tokenizer = tiny
    engine = HFRolloutEngine(model, tokenizer)
    engine.eos_ids = torch.arange(0, len(tokenizer), 17)  # rows end at different steps
    prompts = [tokenizer(t, add_special_tokens=False).input_ids
               for t in ("What is 2 + 3?", "Name a colour.", "Hi")]
    steps, logits = [], []
    original = lean_module.LeanDecoder.step

    def step(self, tokens, positions):
        steps.append(len(tokens))
        out = original(self, tokens, positions)
        logits.append(out)
        return out

    monkeypatch.setattr(lean_module.LeanDecoder, "step", step)
    # 24 rows: the matmul attention from 16 running rows, the fused kernel below
    rollouts = engine.generate(prompts, 8, SamplingParams(max_new_tokens=40), seed=0)
    sampled_steps, sampled_logits = list(steps), list(logits)
    assert len(set(rollouts.lengths.tolist())) > 2
    assert max(sampled_steps) >= lean_module.MATMUL_ATTENTION_FROM_ROWS > min(sampled_steps)
    steps.clear()
    logits.clear()
    weights = lean_module.LeanWeights.of(model, torch.float32, len(rollouts.lengths))
    bench.decode(weights, prompts, 8, 40, rollouts.response_ids, rollouts.lengths,
                 engine.pad_id)
    assert steps == sampled_steps
    for forced, sampled in zip(logits, sampled_logits, strict=True):
        torch.testing.assert_close(forced, sampled)
