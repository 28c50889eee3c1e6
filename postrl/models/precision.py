"""Mixed precision: how a step computes in bf16 while the optimizer keeps float32 weights.

- ``fp32``: everything in float32.
- ``bf16``: autocast. The weights stay float32; matmuls run in bf16 (autocast casts each weight
  once per minibatch and every activation before its matmul); element-wise work and every
  log-softmax stay float32.
- ``bf16-master``: a bf16 working copy of the policy computes the forward and backward (weights,
  activations and their gradients in bf16; RMSNorm, the attention softmax and the vocabulary
  reductions still in float32 inside their modules), while float32 master weights and AdamW's
  moments take the update (Micikevicius et al. 2018, "Mixed Precision Training"). Each
  micro-batch's bf16 gradient is added into the float32 master gradient as soon as autograd
  has it, so accumulation over micro-batches is float32 (on AMX tiles a linear's backward adds
  its weight gradient, summed in float32, into the master's itself: :func:`master_of`); after
  each optimizer step the working copy is refreshed from the masters. Modules that are not
  the policy (the frozen reference, PPO's critic) keep float32 weights and run under
  autocast.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.utils.weak import WeakTensorKeyDictionary

from postrl.models import backend


def autocast(precision: str, device_type: str = "cpu"):
    """Autocast to bf16 for ``precision="bf16"``; a no-op otherwise (the ``bf16-master`` policy
    computes in its own bf16 weights)."""
    return torch.autocast(device_type, dtype=torch.bfloat16, enabled=precision == "bf16")


def float32_module_autocast(precision: str, device_type: str = "cpu"):
    """For modules that keep float32 weights in every mode (reference, critic): autocast in
    either bf16 mode."""
    return torch.autocast(device_type, dtype=torch.bfloat16, enabled=precision != "fp32")


def sampling_dtype(precision: str, model_dtype: torch.dtype) -> torch.dtype:
    """Rollouts sample in bf16 in either bf16 mode, otherwise in the policy's dtype."""
    return torch.bfloat16 if precision != "fp32" else model_dtype


def bf16_copy(model: nn.Module, trainable: bool = False) -> nn.Module:
    """A copy of ``model`` with bf16 parameters (tied ones stay tied), made without a float32
    intermediate. Only the parameters are cast: buffers are copied as they are, so RoPE's
    inverse frequencies stay float32 (``module.to(bf16)`` would round them). ``trainable``
    keeps each parameter's ``requires_grad``; otherwise none requires a gradient."""
    memo = {id(p): nn.Parameter(p.detach().to(torch.bfloat16),
                                requires_grad=trainable and p.requires_grad)
            for p in model.parameters()}
    return copy.deepcopy(model, memo)


_MASTERS = WeakTensorKeyDictionary()  # working parameter -> its float32 master


def master_of(weight: Tensor) -> nn.Parameter | None:
    """The float32 master of a ``bf16-master`` working parameter, where its gradient goes; None
    for any other tensor. A backward may add a float32 gradient into the master's ``.grad``
    itself (a backend's, on AMX tiles) rather than give the working parameter a bf16 one."""
    return _MASTERS.get(weight)


class MasterWeights:
    """``bf16-master``: ``working`` (a bf16 copy of ``master``) runs forward and backward; its
    gradients land, in float32, on ``master``'s parameters, where ``master``'s optimizer finds
    them; :meth:`refresh` copies the updated masters back into ``working``."""

    def __init__(self, master: nn.Module) -> None:
        self.master = master
        self.working = bf16_copy(master, trainable=True)
        self.pairs = [(m, w) for m, w in zip(master.parameters(), self.working.parameters(),
                                             strict=True) if m.requires_grad]
        for m, w in self.pairs:
            w.register_post_accumulate_grad_hook(self._accumulate_into(m))
            _MASTERS[w] = m

    @staticmethod
    def _accumulate_into(master: nn.Parameter):
        def hook(working: nn.Parameter) -> None:
            # float32 accumulation over micro-batches; the bf16 gradient is freed at once
            if working.grad is None:  # a backward gave the master its gradient (master_of)
                return
            if master.grad is None:
                master.grad = working.grad.to(torch.float32)
            else:
                backend.active().add_into(master.grad, working.grad)
            working.grad = None
        return hook

    @torch.no_grad()
    def refresh(self) -> None:
        """The working copy := the masters, rounded to bf16 (after each optimizer step, and
        after masters are loaded from a checkpoint)."""
        for m, w in self.pairs:
            w.copy_(m)


def onednn_runs_bf16() -> bool:
    """oneDNN is there and takes bf16 on this CPU (AVX-512 or AMX): it packs bf16 weights,
    natively fast or not."""
    try:
        return (torch.backends.mkldnn.is_available()
                and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a build without the check
        return False


def cpu_bf16_instructions() -> bool:
    """The CPU multiplies bf16 natively: AVX512-BF16 or AMX tiles (cpuinfo, through
    ``torch.cpu``; /proc/cpuinfo's flags where that is missing)."""
    checks = [getattr(torch.cpu, name, None)
              for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    if all(callable(check) for check in checks):
        return any(check() for check in checks)
    try:  # pragma: no cover - a torch without the checks
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def cpu_has_fast_bf16() -> bool:
    """bf16 matmuls run faster than float32 here: oneDNN takes them and the CPU has bf16
    instructions. On AVX-512 without them oneDNN converts to float32 inside its kernels:
    61 against 333 GFLOP/s for float32 on a 2-core Xeon with AVX-512F alone (bench/log.md)."""
    return onednn_runs_bf16() and cpu_bf16_instructions()


def cpu_bf16_reason() -> str | None:
    """Why bf16 matmuls are slow on this CPU; None where they are fast.

    PyTorch runs bf16 matmuls on the CPU through oneDNN where oneDNN supports bf16 on the CPU
    (AVX-512; natively with AVX512-BF16 or AMX) and through generic fallback kernels elsewhere.
    On a CPU with AVX2 only those measured several times slower than float32, and on AVX-512
    without bf16 instructions oneDNN's emulated kernels 5x slower (bench/log.md)."""
    if cpu_has_fast_bf16():
        return None
    if onednn_runs_bf16():
        return ("this CPU has AVX-512 but no bf16 instructions (AVX512-BF16 or AMX), so "
                "oneDNN emulates bf16 matmuls, several times slower than float32 (5x on a "
                "Xeon with AVX-512F alone)")
    return (f"this CPU has no fast bf16 matmuls (PyTorch's CPU capability: "
            f"{torch.backends.cpu.get_cpu_capability()}; oneDNN's bf16 kernels need AVX-512 or "
            "AMX), so bf16 matmuls run in generic fallback kernels, several times slower "
            "than float32 (a bf16 linear at SmolLM2's shapes: 7x slower on an AVX2 CPU)")


def precision_warning(precision: str) -> str | None:
    """A warning for ``precision`` on this CPU, or None when it runs at full speed here."""
    reason = None if precision == "fp32" else cpu_bf16_reason()
    return (f"precision={precision}: {reason}; precision=fp32 is faster here"
            if reason else None)
