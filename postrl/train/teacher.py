"""The teacher of on-policy distillation (docs/algorithms.md §11): a frozen model that scores
the tokens the student sampled, reading them after its own prompt.

``teacher.model`` names a model as ``model=`` does (it must share the student's tokenizer),
or ``self``: the student's initial weights, which with another prompt (``teacher.system_prompt``
or ``teacher.task_options``, e.g. worked demonstrations) is context distillation (Snell et al.
2022, "Learning by Distilling Context"). The teacher reads the whole episode, the environment's
tokens too, and only the student's own tokens are scored: the response mask is the student's.
"""

from __future__ import annotations

from typing import Any

import torch

from postrl.config import TrainConfig
from postrl.envs import is_environment_task
from postrl.errors import ConfigError
from postrl.models.loading import load_policy
from postrl.models.logprobs import SequenceBatch, response_logprobs
from postrl.models.policy import ReferencePolicy
from postrl.objectives.distill import reverse_kl_tokens
from postrl.rollout import HFRolloutEngine, SamplingParams
from postrl.rollout.episodes import EpisodeLimits
from postrl.tasks import Example, load_task, task_prompt
from postrl.train.batch import response_sequences
from postrl.train.evaluate import Sampler
from postrl.train.sampling import PromptTokens


class FrozenModel:
    """A loaded teacher model: log-probs of a batch's response tokens, without gradients."""

    def __init__(self, model: Any) -> None:
        self.model = model.eval().requires_grad_(False)

    @torch.no_grad()
    def logprobs(self, batch: SequenceBatch, temperature: float) -> torch.Tensor:
        return response_logprobs(self.model, batch, temperature)[0]


class Teacher:
    """A frozen scorer and the prompt it reads each example with."""

    def __init__(self, scorer: FrozenModel | ReferencePolicy, tokenizer: Any, task: Any,
                 system_prompt: str | None, prompt_tokens: PromptTokens) -> None:
        self.scorer, self.tokenizer, self.task = scorer, tokenizer, task
        self.system_prompt, self.prompt_tokens = system_prompt, prompt_tokens

    @classmethod
    def for_run(cls, cfg: TrainConfig, policy: Any, tokenizer: Any, student_task: Any,
                reference: ReferencePolicy | None, device: torch.device) -> Teacher | None:
        """The run's teacher (None without ``teacher.model``). ``self`` shares the reference
        model when the run has one: both are the student's initial weights."""
        spec = cfg.teacher.model
        if not spec:
            return None
        if spec == "self":
            scorer = reference if reference is not None else ReferencePolicy(policy)
            model = policy
        else:
            with torch.random.fork_rng():  # loading leaves the run's random streams alone
                model, theirs = load_policy(spec, seed=cfg.seed)
            _check_same_tokenizer(spec, theirs, tokenizer)
            scorer = FrozenModel(model.to(device))
        task = (load_task(cfg.task, **{**cfg.task_options, **cfg.teacher.task_options})
                if cfg.teacher.task_options else student_task)
        system_prompt = (cfg.teacher.system_prompt if cfg.teacher.system_prompt is not None
                         else cfg.system_prompt)
        return cls(scorer, tokenizer, task, system_prompt,
                   PromptTokens(tokenizer, model, cfg.max_new_tokens))

    def prompt_ids(self, example: Example) -> list[int]:
        """The teacher's prompt of ``example``, tokenized once."""
        prompt = task_prompt(self.tokenizer, self.task, example.question, self.system_prompt)
        return self.prompt_tokens(example.id, prompt)

    def logprobs(self, batch: SequenceBatch, temperature: float) -> torch.Tensor:
        """``[N, T]`` log-probs of the response tokens after the teacher's prompts."""
        return self.scorer.logprobs(batch, temperature)

    def sampler_engine(self, student_engine: Any) -> Any:
        """What samples the teacher's weights: a sampler over a loaded teacher model; for
        ``self``, the student's own engine, which holds them until the student's first
        update."""
        if isinstance(self.scorer, FrozenModel):
            return HFRolloutEngine(self.scorer.model, self.tokenizer)
        return student_engine


def held_out_reverse_kl(student: Any, tokenizer: Any, task: Any, teacher: Teacher,
                        cfg: TrainConfig, batch_prompts: int = 8) -> dict[str, float]:
    """``eval/distill_reverse_kl``: the student's reverse KL to the teacher per token (k1) on
    one sample of each of the first ``eval_n`` held-out prompts, drawn at the training
    temperature with the run's seed. The prompts and seeds are the same at every evaluation
    and in every run of a seed, so the numbers pair across steps and arms."""
    examples = list(task.test())[: cfg.eval_n]
    params = SamplingParams(temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens,
                            stop=tuple(cfg.stop))
    limits = (EpisodeLimits.for_model(cfg.max_turns, cfg.max_new_tokens, student)
              if is_environment_task(task) else None)
    sampler = Sampler(HFRolloutEngine(student, tokenizer), tokenizer,
                      None if limits is None else (task, limits))
    total, tokens = 0.0, 0
    for start in range(0, len(examples), batch_prompts):
        chunk = examples[start : start + batch_prompts]
        ids = sampler.prompt_ids([task_prompt(tokenizer, task, e.question, cfg.system_prompt)
                                  for e in chunk])
        rollouts = sampler.rollouts(chunk, ids, 1, params, cfg.seed + start)
        episodes = rollouts.env_mask is not None
        mine, theirs = (response_sequences(prompts, rollouts.response_ids,
                                           rollouts.response_mask, rollouts.lengths, episodes,
                                           sampler.engine.pad_id).to(student.device)
                        for prompts in (ids, [teacher.prompt_ids(e) for e in chunk]))
        with torch.no_grad():
            student_logp = response_logprobs(student, mine, cfg.temperature)[0]
        teacher_logp = teacher.logprobs(theirs, cfg.temperature)
        mask = rollouts.response_mask[:, : student_logp.shape[1]].to(student_logp.device)
        total += float(reverse_kl_tokens(student_logp, teacher_logp, mask).sum())
        tokens += int(mask.sum())
    return {"eval/distill_reverse_kl": total / tokens} if tokens else {}


def _check_same_tokenizer(spec: str, theirs: Any, tokenizer: Any) -> None:
    """The teacher scores the student's token ids: its vocabulary must be the student's."""
    if theirs.get_vocab() != tokenizer.get_vocab():
        raise ConfigError(f"teacher.model={spec!r} has another tokenizer than the student "
                          f"({len(theirs.get_vocab())} against {len(tokenizer.get_vocab())} "
                          "tokens, or the same ids for other tokens): the teacher scores the "
                          "student's token ids, so both must share one vocabulary")
