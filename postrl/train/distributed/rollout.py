"""Rollouts on Ray actors: the prompts of a round in contiguous slices, one per actor.

Sampling randomness is keyed by ``(seed, prompt index)`` (the engine's ``first_prompt``), so
the completions do not depend on how many actors share a round. Each actor holds its own copy
of the policy (on its GPU when it reserved one); after every training step the new trainable
weights reach it through the Ray object store (``load_weights``) or a broadcast from rank 0.
Ray is imported only where it is used: :class:`RolloutWorker` runs without it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch

from postrl.config import TrainConfig
from postrl.process import configure_process
from postrl.rollout import HFRolloutEngine, Rollouts, SamplingParams
from postrl.rollout.base import cat_right_padded
from postrl.train.distributed.broadcast import WeightChannel, gpu_uuid
from postrl.train.distributed.failures import COLLECTIVE_TIMEOUT, gather
from postrl.train.distributed.weights import Layout, device_label, load_trainable, worker_device
from postrl.train.setup import load_trained_policy, records_entropies


def prompt_slices(prompts: int, workers: int) -> list[tuple[int, int]]:
    """``(start, stop)`` of each worker's contiguous slice of ``prompts``; sizes differ by at
    most one, earlier workers take the larger ones; empty slices are left out."""
    base, extra = divmod(prompts, workers)
    bounds, start = [], 0
    for worker in range(workers):
        stop = start + base + (worker < extra)
        if stop > start:
            bounds.append((start, stop))
        start = stop
    return bounds


def follow_turns(previous: list[list[list[int]]], prompts: list[list[int]]
                 ) -> list[tuple[int, int]]:
    """``(start, stop)`` of each worker's share of ``prompts`` (one per worker, maybe empty):
    each prompt goes to the worker that had the previous call's prompt it extends, so an
    episode's next turn reaches the worker that keeps its context. ``previous[w]`` is what
    worker ``w`` was given last, in call order.

    Episodes keep their order from turn to turn (``postrl.rollout.episodes``), so one walk
    forward over the previous prompts finds each prompt's, and the shares are contiguous. A
    prompt that extends none (or none after the last one found) follows the one before it:
    it is then prefilled whole, and sampled as anywhere else."""
    earlier = [(worker, p) for worker, given in enumerate(previous) for p in given]
    owners, at = [], 0
    for prompt in prompts:
        found = next((i for i in range(at, len(earlier)) if _extends(prompt, earlier[i][1])),
                     None)
        if found is not None:
            at = found
        owners.append(earlier[found][0] if found is not None else owners[-1] if owners else 0)
    # owners never decrease: worker w's share runs from the first owner >= w to the first > w
    return [(sum(o < w for o in owners), sum(o <= w for o in owners))
            for w in range(len(previous))]


def _extends(prompt: list[int], earlier: list[int]) -> bool:
    return len(earlier) <= len(prompt) and prompt[:len(earlier)] == earlier


def cat_rollouts(parts: list[Rollouts], pad_id: int) -> Rollouts:
    """The rollouts of consecutive prompt slices as one call would have returned them."""
    return Rollouts(
        prompt_ids=[p for part in parts for p in part.prompt_ids],
        response_ids=cat_right_padded([p.response_ids for p in parts], pad_id),
        response_mask=cat_right_padded([p.response_mask for p in parts], False),
        logprobs=cat_right_padded([p.logprobs for p in parts], 0.0),
        lengths=torch.cat([p.lengths for p in parts]),
        finish_reasons=[r for p in parts for r in p.finish_reasons],
        texts=[t for p in parts for t in p.texts],
        group_size=parts[0].group_size,
        entropies=(None if any(p.entropies is None for p in parts)
                   else cat_right_padded([p.entropies for p in parts], 0.0)),
        prefill_lengths=(None if any(p.prefill_lengths is None for p in parts)
                         else torch.cat([p.prefill_lengths for p in parts])),
    )


def build_engine(cfg: TrainConfig, policy_state: dict) -> tuple[object, Callable[[dict], None]]:
    """``(engine, load_weights)`` for ``cfg.rollout_backend``, starting from ``policy_state``
    (the driver's full state dict of the causal LM)."""
    from postrl.models.policy import causal_lm

    model, tokenizer = load_trained_policy(cfg)
    lm = causal_lm(model)
    lm.load_state_dict(policy_state)
    if cfg.rollout_backend == "vllm":
        from postrl.rollout.vllm import VLLMRolloutEngine

        engine = VLLMRolloutEngine.from_config(lm, tokenizer, cfg)
        return engine, engine.load_weights
    lm.to(worker_device(cfg))  # on a GPU, HFRolloutEngine samples with transformers' forward
    engine = HFRolloutEngine(lm, tokenizer, batch_size=None, precision=cfg.sampling_precision,
                             entropies=records_entropies(cfg, cfg.build_recipe()))
    return engine, lambda weights: load_trainable(lm, weights)


class RolloutWorker:
    """The body of one rollout actor: a rollout engine over its own copy of the policy.
    ``name`` (``rollout worker 1/2``) is how its errors call it."""

    def __init__(self, cfg: TrainConfig, policy_state: dict, threads: int,
                 name: str = "rollout worker") -> None:
        configure_process(threads, cfg.reuse_freed_memory)
        self.device = worker_device(cfg, name)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.engine, self._load = build_engine(cfg, policy_state)
        self.channel: WeightChannel | None = None  # weight_sync=broadcast
        self.buckets: list[Layout] = []
        self.turns = ExitStack()  # open between open_turns and close_turns

    def pid(self) -> int:
        return os.getpid()

    def device_name(self) -> str:
        return device_label(self.device)

    def generate(self, prompt_ids: list[list[int]], group_size: int, params: SamplingParams,
                 seed: int, first_prompt: int) -> Rollouts:
        return self.engine.generate(prompt_ids, group_size, params, seed,
                                    first_prompt=first_prompt)

    def open_turns(self) -> None:
        """Keep each call's rows for the next (the engine's ``keeping_turns``, where it has
        one: vLLM keeps them by its own prefix caching)."""
        keeping = getattr(self.engine, "keeping_turns", None)
        if keeping is not None:
            self.turns.enter_context(keeping())

    def close_turns(self) -> None:
        self.turns.close()

    def load_weights(self, weights: dict) -> None:
        self._load(weights)

    def gpu_uuid(self) -> str | None:
        return gpu_uuid(self.device)

    def open_channel(self, address: str, rank: int, size: int, backend: str,
                     buckets: list[Layout]) -> None:
        """Join train rank 0's weight channel; ``buckets`` is how its weights are sent."""
        self.channel = WeightChannel(address, rank, size, backend, COLLECTIVE_TIMEOUT)
        self.buckets = buckets

    def receive_weights(self) -> None:
        """Receive and load the weights one bucket at a time, as rank 0 sends them."""
        for part in self.buckets:
            self._load(self.channel.receive(part))


class RolloutPool:
    """The ``RolloutEngine`` protocol over R rollout actors."""

    def __init__(self, actors: list, pad_id: int, resume_hint: str) -> None:
        self.actors = actors
        self.pad_id = pad_id
        self.names = [f"rollout worker {i + 1}/{len(actors)}" for i in range(len(actors))]
        self.resume_hint = resume_hint
        self.previous: list[list[list[int]]] | None = None  # within keeping_turns()

    @contextmanager
    def keeping_turns(self) -> Iterator[None]:
        """Within it, a prompt that extends one of the previous call's goes to the worker
        that had it, which keeps that row's context (``HFRolloutEngine.keeping_turns``): an
        episode's later turns prefill only what is new, as in one process. The shares stay
        contiguous, so prompt ``i`` keeps its sampling key ``(seed, first_prompt + i)``."""
        gather([a.open_turns.remote() for a in self.actors], self.names, self.resume_hint)
        self.previous = [[] for _ in self.actors]
        try:
            yield
        finally:
            self.previous = None
            gather([a.close_turns.remote() for a in self.actors], self.names,
                   self.resume_hint)

    def generate(self, prompt_ids: list[list[int]], group_size: int, params: SamplingParams,
                 seed: int, first_prompt: int = 0) -> Rollouts:
        if self.previous is not None and any(self.previous):
            bounds = follow_turns(self.previous, prompt_ids)
        else:  # empty slices come last: an actor's index is its slice's
            bounds = prompt_slices(len(prompt_ids), len(self.actors))
        shares = [(i, (start, stop)) for i, (start, stop) in enumerate(bounds) if stop > start]
        futures = [self.actors[i].generate.remote(prompt_ids[start:stop], group_size, params,
                                                  seed, first_prompt + start)
                   for i, (start, stop) in shares]
        parts = gather(futures, [self.names[i] for i, _ in shares], self.resume_hint)
        if self.previous is not None:
            self.previous = [[] for _ in self.actors]
            for i, (start, stop) in shares:
                self.previous[i] = [list(p) for p in prompt_ids[start:stop]]
        return cat_rollouts(parts, self.pad_id)

    def load_weights(self, weights: Any) -> None:
        """Every actor reads the new weights from the object store (passed by reference)."""
        gather([a.load_weights.remote(weights) for a in self.actors], self.names,
               self.resume_hint)

    def start_receiving(self) -> list[Any]:
        """Every actor waits for train rank 0's broadcast (see :meth:`finish_receiving`)."""
        return [a.receive_weights.remote() for a in self.actors]

    def finish_receiving(self, futures: list[Any]) -> None:
        gather(futures, self.names, self.resume_hint)
