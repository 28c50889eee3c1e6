"""bench/vs_trl.py gives TRL the prompts postrl's trainer really takes, and refuses a round in
which the two trained on other prompts (TRL itself is not installed here: the bench's venv)."""

import argparse

import pytest

from bench import regimes, vs_trl
from postrl.train.trainer import Trainer


@pytest.mark.parametrize("seed", [0, 1])
def test_prompt_order_is_what_postrls_trainer_takes(tmp_path, seed):
    steps = 3
    cfg = vs_trl.postrl_config(steps, seed)
    cfg.model, cfg.max_new_tokens, cfg.out = "tiny", 4, str(tmp_path / "run")
    trainer = Trainer(cfg)
    taken = vs_trl.record_prompts(trainer)
    for _ in range(steps):
        trainer.train_step()
    order = [row["question"] for row in vs_trl.prompt_order(steps, seed)]
    assert len(taken) == steps
    assert [q for step in taken for q in step] == order
    assert len(order) == steps * vs_trl.PROMPTS


def test_rounds_train_on_other_prompts():
    first, second = (vs_trl.prompt_order(3, seed) for seed in (0, 1))
    assert first != second


def test_a_round_with_other_prompts_is_refused():
    ours = {"prompts": [["a", "b"], ["c", "d"], ["e", "f"]]}
    vs_trl.check_same_prompts(ours, {"prompts": [list(p) for p in ours["prompts"]]}, 0)
    theirs = {"prompts": [["a", "b"], ["c", "x"], ["e", "f"]]}
    with pytest.raises(SystemExit, match=r"round 2: .* at step 1: \[\['c', 'x'\]\]"):
        vs_trl.check_same_prompts(ours, theirs, 1)
    with pytest.raises(SystemExit, match="round 1: .* at step 2"):
        vs_trl.check_same_prompts(ours, {"prompts": ours["prompts"][:2]}, 0)


def test_postrls_micro_batch_is_one_of_32_rows_in_bf16_and_two_of_16_in_fp32():
    """The bench's measured choice (``MICRO_BATCH``); a size given on the command line wins."""
    assert vs_trl.postrl_config(2, 0, "fp32").micro_batch_size == 16
    assert vs_trl.postrl_config(2, 0, "bf16-master").micro_batch_size == 32
    assert vs_trl.postrl_config(2, 0, "bf16").micro_batch_size == 32
    assert vs_trl.postrl_config(2, 0, "bf16-master", micro_batch_size=8).micro_batch_size == 8


@pytest.mark.parametrize("name", ["short", "gsm8k-256", "gsm8k-1024"])
def test_trl_accumulates_its_micro_batches_into_one_step_of_32_rows(name):
    """One generation round, one optimizer step, as postrl; at GSM8K the micro-batch is the
    most rows that, padded to the longest prompt (253 tokens) and the budget, fit postrl's
    token budget."""
    run = vs_trl.Run(regimes.REGIMES[name])
    batch = vs_trl.trl_batch(run)
    rows = batch["per_device_train_batch_size"]
    assert rows * batch["gradient_accumulation_steps"] == vs_trl.PROMPTS * vs_trl.GROUP
    if name != "short":
        width = 253 + run.regime.max_new_tokens
        assert rows * width <= vs_trl.MICRO_BATCH_TOKENS < 2 * rows * width


def test_trls_micro_batch_can_be_resized_to_a_divisor_of_32_only():
    def args(size):
        return type("Args", (), {"regimes": "short", "gsm8k": "unused",
                                 "trl_micro_batch_size": size})()

    assert vs_trl.regimes(args(None))[0].trl_micro_batch == 32
    assert vs_trl.regimes(args(4))[0].trl_micro_batch == 4
    for wrong in (0, 5, 64):
        with pytest.raises(SystemExit, match=f"--trl-micro-batch-size {wrong}: must divide"):
            vs_trl.regimes(args(wrong))


@pytest.mark.parametrize("framework", ["postrl", "trl"])
@pytest.mark.parametrize("named", ["", "postrl", "trl", "postrl,trl"])
@pytest.mark.parametrize("returned", [False, True])
def test_gradient_checkpointing_reaches_the_children_it_names(monkeypatch, framework,
                                                              named, returned):
    """``--gradient-checkpointing`` travels to the named frameworks' command lines and back
    into their runs (which postrl's config and TRL's GRPOConfig read), and
    ``--postrl-return-freed-memory`` to postrl's."""
    commands = []
    monkeypatch.setattr(vs_trl, "run_child",
                        lambda command, *rest: commands.append(command) or {})
    args = argparse.Namespace(gradient_checkpointing=named, rounds=1, postrl_bf16="bf16-master",
                              micro_batch_size=None, postrl_compile=False, steps=1,
                              memory_limit_gb=20.0, postrl_return_freed_memory=returned)
    vs_trl.compare(vs_trl.SHORT, "fp32", args, {"postrl" if framework == "trl"
                                                          else "trl": "skipped"})
    runs = []
    monkeypatch.setattr(vs_trl, "child", lambda framework, steps, seed, run: runs.append(run))
    monkeypatch.setattr("sys.argv", commands[0])
    vs_trl.main()
    assert runs[0].checkpointing is (framework in named.split(","))
    assert runs[0].reuse_freed_memory is not (returned and framework == "postrl")


def test_gradient_checkpointing_names_frameworks_only(monkeypatch):
    monkeypatch.setattr("sys.argv", ["vs_trl.py", "--gradient-checkpointing", "postrl,vllm"])
    with pytest.raises(SystemExit, match="frameworks are postrl and trl"):
        vs_trl.main()
