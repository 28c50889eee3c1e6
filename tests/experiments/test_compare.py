"""``postrl compare``: fairness checks, inert-component warnings, budgets and shared prompts."""

import argparse
import json
import shutil
from pathlib import Path

import pytest
import torch

from postrl.config import load_config
from postrl.errors import ConfigError
from postrl.experiments.compare import (
    NOISE_SEED_STRIDE,
    UNBOUNDED_STEPS,
    add_compare_arguments,
    parse_recipe_spec,
    run_compare,
)
from postrl.experiments.fairness import (
    ON_POLICY_PER_RESPONSE_EQUIVALENT,
    ON_POLICY_TOKEN_EQUIVALENT,
    check_fair,
    warn_indistinguishable,
    warn_several_components,
)
from postrl.objectives import BatchCounts, PolicyLossConfig, PolicyLossInputs, policy_loss
from postrl.objectives import advantages as adv
from postrl.recipes import get_recipe
from postrl.telemetry import read_metrics

REWARDS = str(Path(__file__).parents[1] / "train" / "rewards_for_tests.py")
TINY = ["model=tiny", "prompts_per_step=2", "group_size=4", "max_new_tokens=8", "quiet=true",
        "log_samples=8", f"rewards=[{REWARDS}:length_parity]", "recipe_options.overlong_buffer=4"]


def compare_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_compare_arguments(parser)
    return parser.parse_args(list(argv))


def resolved(*overrides: str) -> dict:
    return load_config(None, list(overrides)).resolved()


# ---- fairness ---------------------------------------------------------------------------------

def test_check_fair_accepts_recipe_and_bookkeeping_differences():
    check_fair([resolved("recipe=grpo", "seed=0", "out=a/grpo/s0"),
                resolved("recipe=dapo", "recipe_options.clip_high=0.3", "seed=1", "out=a/dapo/s1",
                         "quiet=true", "report_to=[tensorboard]")])


def test_check_fair_names_each_differing_field_and_its_values():
    with pytest.raises(ConfigError) as err:
        check_fair([resolved("out=c/grpo/s0"), resolved("lr=1e-4", "lora.r=8", "out=c/dapo/s0")])
    message = str(err.value)
    assert "lr: 1e-06 in grpo/s0; 0.0001 in dapo/s0" in message
    assert "lora.r: 0 in grpo/s0; 8 in dapo/s0" in message
    assert "--vary lora.r --vary lr" in message


def test_check_fair_allows_fields_varied_on_purpose():
    configs = [resolved(), resolved("lr=1e-4", "lora.r=8")]
    check_fair(configs, vary={"lr", "lora"})
    with pytest.raises(ConfigError, match="lora.r"):
        check_fair(configs, vary={"lr"})


# ---- inert components -------------------------------------------------------------------------

def test_token_vs_sequence_ratio_warns_with_one_update_per_batch():
    token = get_recipe("dr_grpo")
    sequence = token.with_(name="dr_grpo_seq", ratio="sequence", clip_low=3e-4, clip_high=4e-4)
    warnings = warn_indistinguishable([token, sequence], updates_per_batch=1)
    assert len(warnings) == 1
    assert "dr_grpo, dr_grpo_seq differ only in ratio, clip" in warnings[0]


def test_token_vs_sequence_ratio_does_not_warn_with_four_minibatches():
    token = get_recipe("dr_grpo")
    sequence = token.with_(ratio="sequence")
    assert warn_indistinguishable([token, sequence], updates_per_batch=4) == []


def test_entropy_guided_hybrid_changes_the_gradient_on_policy_so_no_warning():
    token = get_recipe("dhpo").with_(ratio="token", name="token")
    entropy = get_recipe("dhpo").with_(hybrid_mixing="entropy", name="entropy")
    warnings = warn_indistinguishable([token, entropy], updates_per_batch=1)
    assert [w.split(" ")[0] for w in warnings] == ["clip"]  # the clip ranges are inert, the
    averaged = get_recipe("dhpo").with_(name="averaged")  # ratio unit is not; averaged mixing is
    assert "differ only in ratio, clip" in warn_indistinguishable([token, averaged], 1)[0]


def test_sequence_ratio_with_per_token_advantages_is_not_inert():
    token = get_recipe("reinforce_pp")
    assert warn_indistinguishable([token, token.with_(ratio="sequence")], 1) == []
    assert len(warn_indistinguishable([token, token.with_(ratio="sequence_token")], 1)) == 1


def test_dual_clip_and_identical_components_warn_and_partly_inert_differences_are_noted():
    grpo = get_recipe("grpo")
    assert "dual-clip" in warn_indistinguishable([grpo, grpo.with_(dual_clip=3.0)], 1)[0]
    assert "identical components" in warn_indistinguishable([grpo, grpo.with_(name="g2")], 4)[0]
    notes = warn_indistinguishable([grpo, get_recipe("gspo")], 1)
    assert len(notes) == 2 and all("inert" in n for n in notes)  # ratio and clip; KL differs


def test_arms_apart_in_a_varied_field_are_not_called_a_noise_floor():
    grpo = get_recipe("grpo")
    twin = grpo.with_(name="g2")
    settings = {"grpo": {"sampler_precision": "bf16"}, "g2": {"sampler_precision": "fp32"}}
    assert warn_indistinguishable([grpo, twin], 4, settings) == []
    same = {"grpo": {"sampler_precision": "bf16"}, "g2": {"sampler_precision": "bf16"}}
    assert "identical components" in warn_indistinguishable([grpo, twin], 4, same)[0]


def _on_policy_grad(ratio: str, advantages, logp, mask, entropy, aggregation: str):
    leaf = logp.clone().requires_grad_(True)
    cfg = PolicyLossConfig(ratio=ratio, aggregation=aggregation, norm_constant=7.0,
                           clip_low=0.2 if ratio != "geometric" else 0.4, clip_high=0.28)
    policy_loss(PolicyLossInputs(leaf, leaf.detach(), advantages, mask, entropy=entropy), cfg,
                BatchCounts.of(mask)).loss.backward()
    return leaf.grad


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_the_units_called_equivalent_on_policy_have_the_token_gradient(aggregation):
    """The claims warn_indistinguishable relies on, checked on the loss itself."""
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 8, (6,), generator=gen)
    mask = (torch.arange(7) < lengths.unsqueeze(1)).double()
    logp = -torch.rand(6, 7, generator=gen, dtype=torch.float64) * 3
    entropy = torch.rand(6, 7, generator=gen, dtype=torch.float64)
    per_response = adv.group(torch.tensor([0.0, 1, 1, 0, 1, 1], dtype=torch.float64), 3)
    per_token = torch.randn(6, 7, generator=gen, dtype=torch.float64) * mask
    for advantages, units in ((per_response, ON_POLICY_TOKEN_EQUIVALENT
                               | ON_POLICY_PER_RESPONSE_EQUIVALENT),
                              (per_token, ON_POLICY_TOKEN_EQUIVALENT)):
        token = _on_policy_grad("token", advantages, logp, mask, entropy, aggregation)
        for unit in units:
            grad = _on_policy_grad(unit, advantages, logp, mask, entropy, aggregation)
            torch.testing.assert_close(grad, token, rtol=0, atol=1e-12, msg=unit)
    sequence = _on_policy_grad("sequence", per_token, logp, mask, entropy, aggregation)
    token = _on_policy_grad("token", per_token, logp, mask, entropy, aggregation)
    assert not torch.allclose(sequence, token)


# ---- parsing ----------------------------------------------------------------------------------

def test_recipe_spec_splits_components_from_shared_options():
    spec = parse_recipe_spec("dapo:clip_high=0.3,max_new_tokens=16,stop=[a,b]")
    assert spec.preset == "dapo" and spec.label == "dapo+clip_high=0.3+max_new_tokens=16+stop=_a+b_"
    assert spec.overrides == ("recipe_options.clip_high=0.3", "max_new_tokens=16", "stop=[a,b]")
    with pytest.raises(ConfigError, match="'clip_hi' is neither"):
        parse_recipe_spec("dapo:clip_hi=0.3")
    with pytest.raises(ConfigError, match="unknown recipe"):
        parse_recipe_spec("dappo")


def test_recipes_more_than_one_component_apart_are_warned_about():
    grpo, dr_grpo = get_recipe("grpo"), get_recipe("dr_grpo")
    no_kl = grpo.with_("grpo_no_kl", kl_placement="none", kl_coef=0.0)
    (warning,) = warn_several_components([grpo, dr_grpo, no_kl])
    assert warning.startswith("dr_grpo differs from grpo in 3 components (advantage, ")
    assert "postrl ladder grpo dr_grpo" in warning
    # one component apart: the comparison the issue asks for (GRPO without its KL term
    # against Dr. GRPO differs in the advantage's scaling and the aggregation)
    assert warn_several_components([no_kl, no_kl.with_("other", clip_high=0.28)]) == []
    # a ladder compares each rung with the one before it
    rungs = [no_kl, no_kl.with_("a", clip_high=0.28),
             no_kl.with_("b", clip_high=0.28, aggregation="token_mean")]
    assert warn_several_components(rungs, consecutive=True) == []
    assert len(warn_several_components(rungs)) == 1


def test_compare_prints_the_components_apart_warning_before_training(tmp_path, capsys):
    args = compare_args("grpo", "dapo", "--dry-run", "--out", str(tmp_path / "cmp"), *TINY)
    assert run_compare(args) == 0
    out = capsys.readouterr().out
    assert ("warning: dapo differs from grpo in 5 components (clip, aggregation, KL, dynamic "
            "sampling, overlong shaping)") in out


# ---- end to end on the tiny model -------------------------------------------------------------

def test_unfair_comparison_is_refused_before_training(tmp_path, monkeypatch):
    def no_training(cfg):
        raise AssertionError("trained before the fairness check")

    monkeypatch.setattr("postrl.train.trainer.Trainer", no_training)
    args = compare_args("grpo", "dapo:max_new_tokens=16", "--seeds", "2", "--out",
                        str(tmp_path / "cmp"), *TINY)
    with pytest.raises(ConfigError, match=r"max_new_tokens: 8 in grpo/s0, grpo/s1; 16 in"):
        run_compare(args)
    assert not (tmp_path / "cmp").exists()
    args = compare_args("grpo", "dapo:max_new_tokens=16", "--vary", "max_new_tokens",
                        "--dry-run", "--out", str(tmp_path / "cmp"), *TINY)
    assert run_compare(args) == 0


def _first_step_prompts(run: Path) -> list[str]:
    rows = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    return [r["prompt"] for r in rows if r["step"] == 1]


def test_compare_respects_the_token_budget_and_shares_prompts_per_seed(tmp_path, monkeypatch,
                                                                       capsys):
    budget = 150
    out = tmp_path / "cmp"
    args = compare_args("grpo", "dapo", "--seeds", "2", "--token-budget", str(budget), "--out",
                        str(out), *TINY)
    assert run_compare(args) == 0
    printed = capsys.readouterr().out
    assert "2 recipes x 2 seeds [0, 1]" in printed
    prompts = {}
    for label in ("grpo", "dapo"):
        for seed in (0, 1):
            run = out / label / f"s{seed}"
            rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
            totals = [0] + [r["rollout/tokens_generated"] for r in rows]
            last_step = totals[-1] - totals[-2]
            assert totals[-2] < budget <= totals[-1] <= budget + last_step
            saved = (run / "config.yaml").read_text()
            assert f"token_budget: {budget}" in saved and f"steps: {UNBOUNDED_STEPS}" in saved
            prompts[label, seed] = _first_step_prompts(run)
            assert len(prompts[label, seed]) == 8
    for seed in (0, 1):
        assert prompts["grpo", seed] == prompts["dapo", seed]
    assert prompts["grpo", 0] != prompts["grpo", 1]
    manifest = json.loads((out / "comparison.json").read_text())
    assert [r["label"] for r in manifest["runs"]] == ["grpo", "grpo", "dapo", "dapo"]
    assert (out / "report.html").is_file()
    assert "dapo - grpo, paired by seed (differs in: clip: " in printed


def test_compare_prints_paired_differences_over_five_seeds(tmp_path, capsys):
    """The issue's must-show on the tiny model: GRPO without its KL term against Dr. GRPO."""
    args = compare_args("grpo:kl_coef=0", "dr_grpo", "--seeds", "5", "--token-budget", "60",
                        "--out", str(tmp_path / "cmp"), *TINY)
    assert run_compare(args) == 0
    printed = capsys.readouterr().out
    heading = next(line for line in printed.splitlines() if "paired by seed" in line)
    assert heading.startswith("dr_grpo - grpo+kl_coef=0, paired by seed (differs in: advantage")
    assert "aggregation: constant-normalised" in heading
    table = printed[printed.index(heading):].splitlines()
    assert table[1].split() == ["metric", "arms", "per-seed", "differences", "mean", "[95%",
                                "CI]", "p", "MDE", "(80%)"]
    lengths = next(line for line in table if line.startswith("length/mean "))
    finals = {}
    for label in ("grpo+kl_coef=0", "dr_grpo"):
        for seed in range(5):
            rows = read_metrics(tmp_path / "cmp" / label / f"s{seed}" / "metrics.jsonl")
            finals[label, seed] = rows[-1]["length/mean"]
    differences = [finals["dr_grpo", s] - finals["grpo+kl_coef=0", s] for s in range(5)]
    assert ", ".join(f"{d:.3g}" for d in differences) in lengths  # seed by seed, in order
    assert "cannot go below 0.0625 two-sided" in printed  # the floor of 5 pairs is stated


def test_a_repeated_recipe_samples_its_own_responses_from_the_same_prompts(tmp_path, capsys):
    """``compare grpo grpo``, the noise floor: the copy gets its own sampling stream, so the
    two arms differ only by chance and their paired differences measure that chance."""
    out = tmp_path / "floor"
    args = compare_args("grpo", "grpo", "--seeds", "2", "--token-budget", "40", "--out",
                        str(out), *TINY)
    assert run_compare(args) == 0
    printed = capsys.readouterr().out
    assert ("grpo-2 - grpo, paired by seed (differs in: no component; only the sampled "
            "responses, a noise floor)") in printed
    for seed in (0, 1):
        first, copy = out / "grpo" / f"s{seed}", out / "grpo-2" / f"s{seed}"
        assert f"sampling_seed: {seed + NOISE_SEED_STRIDE}" in (copy / "config.yaml").read_text()
        assert "sampling_seed: null" in (first / "config.yaml").read_text()
        assert _first_step_prompts(first) == _first_step_prompts(copy)
        completions = [[json.loads(x)["completion"] for x in
                        (run / "samples.jsonl").read_text().splitlines()] for run in (first, copy)]
        assert completions[0] != completions[1]


def test_resume_keeps_finished_runs_and_continues_the_others(tmp_path, capsys):
    out = tmp_path / "cmp"
    argv = ["grpo", "dr_grpo", "--seeds", "1", "--token-budget", "40", "--out", str(out),
            *TINY, "save_every=1", "--keep-checkpoints"]  # as a run killed before pruning
    assert run_compare(compare_args(*argv)) == 0
    finished_metrics = (out / "grpo" / "s0" / "metrics.jsonl").read_bytes()
    interrupted = out / "dr_grpo" / "s0"
    shutil.rmtree(interrupted / "final")  # as if killed after its last checkpoint
    steps = len(read_metrics(interrupted / "metrics.jsonl"))
    with pytest.raises(ConfigError, match="already hold runs"):
        run_compare(compare_args(*argv))
    capsys.readouterr()
    assert run_compare(compare_args(*argv, "--resume")) == 0
    printed = capsys.readouterr().out
    assert "grpo seed 0 -> " in printed and "(finished: kept)" in printed
    assert (out / "grpo" / "s0" / "metrics.jsonl").read_bytes() == finished_metrics
    assert (interrupted / "final" / "config.json").is_file()
    assert len(read_metrics(interrupted / "metrics.jsonl")) == steps  # continued, not redone
    with pytest.raises(ConfigError, match=r"cannot resume from .*grpo/s0: the run's options "
                                          r"changed \(lr"):
        run_compare(compare_args(*argv, "--resume", "lr=0.5"))


def test_compare_runs_two_recipes_on_a_multi_turn_environment_at_one_token_budget(
        tmp_path, capsys):
    """Issue 43's must-show: the budget counts the model's tokens; the environment's are
    reported apart, per arm and paired."""
    out = tmp_path / "env"
    args = compare_args("grpo:kl_coef=0", "dr_grpo", "--seeds", "1", "--token-budget", "60",
                        "--out", str(out), *TINY, "task=guess_number", "stop=[e]",
                        "max_turns=3", "max_new_tokens=12",
                        f"rewards=[environment, {REWARDS}:length_parity]")
    assert run_compare(args) == 0
    printed = capsys.readouterr().out
    assert any(line.startswith("episode/env_tokens_mean") for line in printed.splitlines())
    for label in ("grpo+kl_coef=0", "dr_grpo"):
        rows = read_metrics(out / label / "s0" / "metrics.jsonl")
        generated = [r["rollout/tokens_generated"] for r in rows]
        assert generated[-1] >= 60 > generated[-2]  # stopped by the budget of model tokens
        assert all(r["episode/env_tokens_mean"] > 0 for r in rows)


def test_compare_runs_a_stale_arm_one_component_apart(tmp_path, capsys):
    """Issue 62's must-show: ``compare grpo grpo:max_staleness=4`` runs both at one token
    budget and names staleness as the one component between them."""
    args = compare_args("grpo", "grpo:max_staleness=4", "--seeds", "2", "--token-budget", "300",
                        "--out", str(tmp_path / "cmp"), *TINY)
    assert run_compare(args) == 0
    printed = capsys.readouterr().out
    heading = next(line for line in printed.splitlines() if "paired by seed" in line)
    assert heading == ("grpo+max_staleness=4 - grpo, paired by seed (differs in: staleness: "
                       "up to 4 updates: step t trains on samples of the weights after update "
                       "max(0, t - 4)):")
    for seed in (0, 1):
        stale = read_metrics(tmp_path / "cmp" / "grpo+max_staleness=4" / f"s{seed}" /
                             "metrics.jsonl")
        assert [r["async/staleness_max"] for r in stale][:5] == [0, 1, 2, 3, 4]
        assert stale[-1]["rollout/tokens_generated"] >= 300


def test_compare_shows_each_runs_cost_says_its_disk_and_prunes_finished_runs(tmp_path, capsys):
    """Issue 63's item 3: steps and tokens (wasted ones included) beside the results; the
    disk the runs will hold, said first; a finished run's checkpoints removed (kept with
    --keep-checkpoints), its final policy and logs kept."""
    out = tmp_path / "cmp"
    argv = ["grpo", "dapo", "--seeds", "1", "--token-budget", "80", "--out", str(out), *TINY,
            "save_every=1", f"rewards=[{REWARDS}:parity_on_odd_answers]"]
    assert run_compare(compare_args(*argv)) == 0
    printed = capsys.readouterr().out
    assert "disk: about " in printed and "removed once each run has finished" in printed
    table = printed[printed.index("cost per run"):].splitlines()
    assert table[1].split() == ["arm", "seed", "steps", "tokens", "generated", "of", "which",
                                "wasted"]
    for row in table[3:5]:
        label, seed, steps, generated, wasted = row.split()
        records = read_metrics(out / label / f"s{seed}" / "metrics.jsonl")
        assert int(steps) == records[-1]["step"]
        assert int(generated) == records[-1]["rollout/tokens_generated"] >= 80
        assert int(wasted) == records[-1]["rollout/tokens_wasted"]
        assert not (out / label / f"s{seed}" / "checkpoints").exists()
        assert (out / label / f"s{seed}" / "final" / "config.json").is_file()
    assert any(int(row.split()[4]) > 0 for row in table[3:5])  # dapo dropped groups
    kept = tmp_path / "kept"
    argv[argv.index(str(out))] = str(kept)
    assert run_compare(compare_args(*argv, "--keep-checkpoints")) == 0
    assert list((kept / "grpo" / "s0" / "checkpoints").glob("step_*"))


def test_compare_names_a_varied_field_and_drops_finished_runs_weights(tmp_path, capsys):
    """An arm apart from the first in a field varied on purpose (the sampler's precision) is
    said to differ in it, not called a noise floor; with --drop-weights a finished run keeps
    its logs and final config (so --resume skips it), not its weights."""
    out = tmp_path / "cmp"
    argv = ["grpo", "grpo:sampler_precision=fp32", "--seeds", "1", "--token-budget", "40",
            "--out", str(out), "--vary", "sampler_precision", "--drop-weights", *TINY,
            "sampler_precision=bf16"]
    assert run_compare(compare_args(*argv)) == 0
    printed = capsys.readouterr().out
    assert "  grpo+sampler_precision=fp32: sampler_precision=fp32" in printed
    assert "identical components" not in printed and "noise floor" not in printed
    assert "(differs in: sampler_precision=fp32):" in printed
    assert "one final policy of" in printed
    for label in ("grpo", "grpo+sampler_precision=fp32"):
        final = out / label / "s0" / "final"
        assert (final / "config.json").is_file() and not list(final.glob("*.safetensors"))
        assert read_metrics(out / label / "s0" / "metrics.jsonl")[-1]["step"] >= 1
    assert run_compare(compare_args(*argv, "--resume")) == 0
    assert capsys.readouterr().out.count("(finished: kept)") == 2
