"""bench/regimes.py: the reasoning regimes `make bench` measures, their reward (it varies within
groups), what a step must compute, and the roofline built on it; bench/vs_trl.py's memory limit
and its report of a framework that did not fit."""

import subprocess
import sys

import pytest

from bench import children, regimes, vs_trl, vs_trl_report
from postrl.train.trainer import Trainer


def test_closeness_is_one_when_right_and_falls_with_the_distance():
    completions = ["so it is 220", "The answer is 200.", "#### 110", "I cannot tell",
                   [{"role": "assistant", "content": "#### 220"}]]  # TRL's chat completions
    scores = regimes.answer_closeness([""] * 5, completions, ["220"] * 5)
    assert scores[0] == scores[4] == 1.0
    assert scores[2] < scores[1] < 1.0
    assert scores[1] == pytest.approx(1 / (1 + 20 / 220))
    assert scores[3] == 0.0


def test_an_unknown_regime_or_a_missing_data_file_is_named(tmp_path):
    with pytest.raises(SystemExit, match="unknown gsm8k-512; known: short, gsm8k-256"):
        regimes.parse_regimes("short,gsm8k-512")
    missing = tmp_path / "train.jsonl"
    with pytest.raises(SystemExit, match=f"gsm8k-256: gsm8k data '{missing}' does not exist; "
                                         "pass --gsm8k PATH"):
        regimes.parse_regimes("gsm8k-256", missing)
    assert regimes.parse_regimes("short", missing)[0].task == "arithmetic"


def gsm8k_regime(tmp_path, lines=40):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(
        f'{{"question": "What is {i} + {i}?", "answer": "Double it.\\n#### {2 * i}"}}\n'
        for i in range(lines)))
    return regimes.parse_regimes("gsm8k-256", data)[0]


def tiny_trainer(regime, tmp_path, steps):
    cfg = vs_trl.postrl_config(steps, 0, regime=regime)
    cfg.model, cfg.max_new_tokens, cfg.out = "tiny", 6, str(tmp_path / "run")
    return Trainer(cfg)


def test_postrl_and_trl_get_the_gsm8k_prompts_and_the_closeness_reward(tmp_path):
    regime = gsm8k_regime(tmp_path)
    trainer = tiny_trainer(regime, tmp_path, 2)
    assert trainer.cfg.rewards == [f"{regimes.__file__}:answer_closeness"]
    taken = vs_trl.record_prompts(trainer)
    rows = [trainer.train_step() for _ in range(2)]
    order = vs_trl.prompt_order(2, 0, regime)
    assert [q for step in taken for q in step] == [r["question"] for r in order]
    assert {r["answer"] for r in order} <= {str(2 * i) for i in range(40)}
    assert all("reward/mean" in r for r in rows)


def test_step_work_counts_the_batch_the_update_got(tmp_path):
    trainer = tiny_trainer(gsm8k_regime(tmp_path), tmp_path, 2)
    works, batches = vs_trl.record_work(trainer), []
    update = trainer.phases.update
    trainer.phases.update = lambda batch: batches.append(batch) or update(batch)
    rows = [trainer.train_step() for _ in range(2)]
    assert len(works) == 2
    work, batch = regimes.StepWork(**works[1]), batches[1]
    lengths = batch.lengths.tolist()
    prompts = [len(batch.prompt_ids[i]) for i in range(0, batch.rows, batch.group_size)]
    assert work.generated == sum(lengths) == round(rows[1]["length/mean"] * batch.rows)
    assert work.decode_steps == max(lengths)
    assert work.prompt_tokens == sum(prompts)
    assert work.prompt_pairs == sum(p * (p + 1) // 2 for p in prompts)
    first = prompts[0]  # row 0's tokens attend to the prompt and the response so far
    assert regimes._pairs(first, lengths[0]) == sum(first + t for t in range(1, lengths[0] + 1))
    trained_rows, trained = regimes.trained_tokens(trainer, batch)
    assert work.trained == trained
    assert work.trained_pairs <= work.generated_pairs + work.prompt_pairs
    config = trainer.lm.config
    assert work.layers == config.num_hidden_layers
    assert work.weight_bytes == 4 * work.params  # the tiny model samples in float32


def test_roofline_adds_the_flops_at_the_peak_and_decoding_at_its_bound():
    work = regimes.StepWork(params=1000, layers=2, width=8, kv_bytes_per_token=64,
                            weight_bytes=4000, prompt_tokens=10, prompt_pairs=55,
                            generated=40, generated_pairs=300, decode_steps=20,
                            trained=50, trained_pairs=355)
    attention = 4 * 2 * 8
    prefill = 2 * 1000 * 10 + attention * 55
    backward = 4 * 1000 * 50 + 2 * attention * 355
    decode_flops = 2 * 1000 * 40 + attention * 300
    decode_bytes = 20 * 4000 + 64 * 300
    # a fast memory: decoding is bound by its arithmetic; a slow one: by its reads
    fast = regimes.roofline_s(work, peak_gflops=1e-6, bandwidth_gbs=1.0)
    assert fast == pytest.approx((prefill + backward + decode_flops) / 1e3)
    slow = regimes.roofline_s(regimes.as_dict(work), peak_gflops=1e-6, bandwidth_gbs=1e-9)
    assert slow == pytest.approx((prefill + backward) / 1e3 + decode_bytes)


def test_a_child_over_its_memory_limit_fails_with_an_allocation_error():
    allocate = "import torch; torch.empty(2**30).sum()"  # 4 GB
    out = subprocess.run([sys.executable, "-c", allocate], capture_output=True, text=True,
                         preexec_fn=children.memory_limit(2.0))
    assert out.returncode != 0
    assert children.out_of_memory(out.stderr, 2.0) == (
        "out of memory: needs more than 2.0 GB; 4.29 GB more failed")
    assert children.out_of_memory("ValueError: bad config", 2.0) is None


def test_the_frame_that_ran_out_of_memory_is_named():
    stderr = """Traceback (most recent call last):
  File "/v/lib/python3.11/site-packages/trl/trainer/grpo_trainer.py", line 9, in train
  File "/v/lib/python3.11/site-packages/transformers/generation/utils.py", line 7, in generate
RuntimeError: DefaultCPUAllocator: can't allocate memory: you tried to allocate 1500000000 bytes
"""
    assert children.out_of_memory(stderr, 21.2) == (
        "out of memory: needs more than 21.2 GB; 1.50 GB more failed in generate "
        "(transformers/generation/utils.py)")


def test_a_framework_that_did_not_fit_is_reported_and_postrl_stands_alone(capsys):
    postrl = {"step_s": [10.0], "generate_s": [4.0], "train_s": [6.0], "warmup_s": [12.0],
              "zero_variance": [0.0], "reward": [0.5], "tokens": [5000.0],
              "peak_rss_mb": 4000.0, "work": []}
    failed = {"failed": "out of memory: needs more than 21 GB"}
    table = {"fp32": {"postrl": vs_trl_report.summary([postrl], 100.0, 10.0),
                      "trl": vs_trl_report.summary([failed], 100.0, 10.0)}}
    vs_trl_report.report(regimes.REGIMES["gsm8k-1024"], table, lambda framework, setting: setting)
    printed = capsys.readouterr().out
    assert "trl fp32           did not run: out of memory: needs more than 21 GB" in printed
    assert "gsm8k-1024: TRL did not run; postrl alone" in printed
    assert "speedup" not in printed
    assert "2.00" in printed  # postrl's 10 s for 5,000 tokens: 2 ms a token


def test_a_framework_out_of_memory_is_not_run_at_longer_responses():
    failed = {("trl", "fp32"): 256}
    assert vs_trl.not_to_run(failed, "fp32", 1024) == {
        "trl": "it ran out of memory at 256 new tokens"}
    assert vs_trl.not_to_run(failed, "fp32", 256) == {
        "trl": "it ran out of memory at 256 new tokens"}
    assert vs_trl.not_to_run(failed, "fp32", 64) == {}
    assert vs_trl.not_to_run(failed, "bf16", 1024) == {}  # another setting may fit


def test_a_child_gives_its_result_its_memory_failure_or_a_named_error(tmp_path, monkeypatch):
    """The child runs as a module, imports ``bench`` from another directory than the
    repository's root, and keeps the path it was given."""
    (tmp_path / "child.py").write_text(
        "import sys, torch\n"
        "import bench.children\n"
        "if sys.argv[1] == 'big': torch.empty(2**30).sum()\n"
        "if sys.argv[1] == 'bad': raise ValueError('no such option')\n"
        "print('noise'); print('RESULT {\"step_s\": 1.5}')\n")
    monkeypatch.chdir(tmp_path.parent)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    assert children.run_child(["child", "ok"], 2.0, "ok child") == {"step_s": 1.5}
    assert children.run_child(["child", "big"], 2.0, "big child") == {
        "failed": "out of memory: needs more than 2.0 GB; 4.29 GB more failed"}
    with pytest.raises(SystemExit, match="bad child failed:\n(.|\n)*ValueError: no such option"):
        children.run_child(["child", "bad"], 2.0, "bad child")
