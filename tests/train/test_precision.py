"""Neither bf16 mode may change the maths beyond a documented tolerance (docs/performance.md):
one step's loss and gradients in bf16 (autocast; a bf16 working copy over float32 masters)
against fp32, on the tiny model."""

import warnings
from pathlib import Path

import pytest
import torch

from postrl.models import load_policy
from postrl.models.logprobs import SequenceBatch, response_logprobs
from postrl.models.precision import MasterWeights, autocast, cpu_bf16_reason, precision_warning
from postrl.objectives import BatchCounts, PolicyLossConfig, PolicyLossInputs, policy_loss
from postrl.train.trainer import Trainer
from tests.train.test_trainer import tiny_config

LOSS_TOLERANCE = 1e-3  # relative, on the loss (measured: 6.5e-5)
GRADIENT_COSINE = 0.999  # cosine of the full parameter gradients (measured: 1.0000)


def one_step(model, batch, mask, advantages, old, precision):
    model.zero_grad(set_to_none=True)
    with autocast(precision):
        logp, _ = response_logprobs(model, batch)
    cfg = PolicyLossConfig(ratio="token", clip_low=0.2, clip_high=0.28, aggregation="token_mean")
    out = policy_loss(PolicyLossInputs(logp, old, advantages, mask), cfg, BatchCounts.of(mask))
    out.loss.backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return out.loss.item(), grads, logp.detach()


def test_bf16_autocast_matches_fp32_within_tolerance():
    model, tokenizer = load_policy("tiny", seed=3)
    generator = torch.Generator().manual_seed(0)
    prompts = [tokenizer(f"What is {i} + {i}?", add_special_tokens=False).input_ids
               for i in range(6)]
    responses = torch.randint(100, 5000, (6, 10), generator=generator)
    mask = torch.arange(10) < torch.tensor([10, 7, 3, 10, 1, 5]).unsqueeze(1)
    batch = SequenceBatch.build(prompts, responses, mask, tokenizer.pad_token_id)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0])
    with torch.no_grad():  # the same old log-probs for both: a slightly off-policy batch
        logp, _ = response_logprobs(model, batch)
    old = logp + 0.05 * torch.sin(torch.arange(logp.numel()).view_as(logp).float())
    loss32, grad32, logp32 = one_step(model, batch, mask, advantages, old, "fp32")
    loss16, grad16, logp16 = one_step(model, batch, mask, advantages, old, "bf16")
    assert logp16.dtype == torch.float32  # log-softmax stays in float32
    assert abs(loss16 - loss32) <= LOSS_TOLERANCE * abs(loss32)
    assert (logp16 - logp32)[mask].abs().max() < 1e-2  # measured: 1.3e-3
    cosine = torch.nn.functional.cosine_similarity(grad16, grad32, dim=0)
    assert cosine > GRADIENT_COSINE
    assert all(p.dtype == torch.float32 for p in model.parameters())  # master weights



def rows_data(model, tokenizer):
    """Six rows, their advantages, and fixed old log-probs (the float32 model's, shifted: a
    slightly off-policy batch, so that the loss depends on the new log-probs)."""
    generator = torch.Generator().manual_seed(0)
    prompts = [tokenizer(f"What is {i} + {i}?", add_special_tokens=False).input_ids
               for i in range(6)]
    responses = torch.randint(100, 5000, (6, 10), generator=generator)
    mask = torch.arange(10) < torch.tensor([10, 7, 3, 10, 1, 5]).unsqueeze(1)
    with torch.no_grad():
        logp, _ = response_logprobs(model, SequenceBatch.build(prompts, responses, mask,
                                                               tokenizer.pad_token_id))
    old = logp + 0.05 * torch.sin(torch.arange(logp.numel()).view_as(logp).float())
    return prompts, responses, mask, torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0]), old


def backward_in_micro_batches(model, data, parts, pad_id):
    """The token-mean loss of all rows, each micro-batch (a list of rows) run and backward-ed
    on its own with the global counts; the summed loss."""
    prompts, responses, mask, advantages, old = data
    cfg = PolicyLossConfig(ratio="token", clip_low=0.2, clip_high=0.28, aggregation="token_mean")
    counts, total = BatchCounts.of(mask), 0.0
    for rows in parts:
        index = torch.tensor(rows)
        batch = SequenceBatch.build([prompts[r] for r in rows], responses[index], mask[index],
                                    pad_id)
        logp, _ = response_logprobs(model, batch)
        out = policy_loss(PolicyLossInputs(logp, old[index], advantages[index], mask[index]),
                          cfg, counts)
        out.loss.backward()
        total += out.loss.item()
    return total


def flat_grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def test_bf16_master_matches_fp32_and_accumulates_in_float32():
    model, tokenizer = load_policy("tiny", seed=3)
    data, pad = rows_data(model, tokenizer), tokenizer.pad_token_id
    parts = [[0, 1, 2], [3, 4, 5]]
    loss32 = backward_in_micro_batches(model, data, parts, pad)
    grad32 = flat_grads(model)
    model.zero_grad(set_to_none=True)

    master = MasterWeights(model)
    assert all(p.dtype == torch.bfloat16 for p in master.working.parameters())
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert master.working.lm_head.weight is master.working.model.embed_tokens.weight  # tied
    assert master.working.model.rotary_emb.inv_freq.dtype == torch.float32
    loss16 = backward_in_micro_batches(master.working, data, parts, pad)
    grad16 = flat_grads(model)  # the hooks moved every gradient onto the masters
    assert grad16.dtype == torch.float32
    assert all(p.grad is None for p in master.working.parameters())
    assert loss16 != loss32 and abs(loss16 - loss32) <= LOSS_TOLERANCE * abs(loss32)
    assert torch.nn.functional.cosine_similarity(grad16, grad32, dim=0) > GRADIENT_COSINE

    # accumulation over micro-batches is float32: the sum of each part's own gradient
    separate = []
    for part in parts:
        model.zero_grad(set_to_none=True)
        backward_in_micro_batches(master.working, data, [part], pad)
        separate.append(flat_grads(model).clone())
    assert torch.allclose(grad16, separate[0] + separate[1], rtol=0, atol=1e-7)
    assert not torch.equal((separate[0].bfloat16() + separate[1].bfloat16()).float(), grad16)


def test_bf16_master_steps_the_masters_and_refreshes_the_working_copy():
    model, tokenizer = load_policy("tiny", seed=3)
    master = MasterWeights(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = [p.detach().clone() for p in model.parameters()]
    backward_in_micro_batches(master.working, rows_data(model, tokenizer),
                              [[0, 1, 2, 3, 4, 5]], tokenizer.pad_token_id)
    optimizer.step()
    master.refresh()
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    for p, w in zip(model.parameters(), master.working.parameters(), strict=True):
        assert torch.equal(w, p.detach().bfloat16())


def test_a_cpu_without_fast_bf16_matmuls_is_named_and_fp32_never_warns(monkeypatch):
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    reason = cpu_bf16_reason()
    assert reason is not None and torch.backends.cpu.get_cpu_capability() in reason
    assert precision_warning("fp32") is None
    for precision in ("bf16", "bf16-master"):
        message = precision_warning(precision)
        assert message.startswith(f"precision={precision}: ") and message.endswith(
            "precision=fp32 is faster here")


def test_avx512_without_bf16_instructions_is_named_slow(monkeypatch):
    """oneDNN takes bf16 on any AVX-512 CPU, but without AVX512-BF16 or AMX it emulates it:
    the check goes by the instructions, not by oneDNN's word alone."""
    from postrl.models import precision

    monkeypatch.setattr(precision, "onednn_runs_bf16", lambda: True)
    monkeypatch.setattr(precision, "cpu_bf16_instructions", lambda: False)
    assert not precision.cpu_has_fast_bf16()
    assert "no bf16 instructions" in precision.precision_warning("bf16-master")
    monkeypatch.setattr(precision, "cpu_bf16_instructions", lambda: True)
    assert precision.cpu_has_fast_bf16() and precision.precision_warning("bf16-master") is None


def test_the_bf16_instructions_are_read_from_the_cpu():
    flags = set(Path("/proc/cpuinfo").read_text().split()) if Path("/proc/cpuinfo").exists() \
        else None
    if flags is None:
        pytest.skip("no /proc/cpuinfo to compare with")
    from postrl.models.precision import cpu_bf16_instructions

    assert cpu_bf16_instructions() == bool(flags & {"avx512_bf16", "amx_bf16", "amx_tile"})


@pytest.mark.parametrize("precision, warns", [("bf16", True), ("fp32", False)])
def test_the_trainer_warns_at_start_when_bf16_would_be_slow_here(tmp_path, monkeypatch,
                                                                  precision, warns):
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Trainer(tiny_config(tmp_path, "grpo", f"precision={precision}", "steps=1"))
    ours = [str(w.message) for w in caught if "fast bf16 matmuls" in str(w.message)]
    assert len(ours) == int(warns)
    assert all(m.startswith("precision=bf16: ") for m in ours)
