"""Reward functions for trainer tests: a randomly initialised model never answers correctly,
so these reward properties of the text it does produce (loaded as user rewards by path)."""


def length_parity(prompts, completions, **columns):
    """1.0 for completions with an even number of characters: varied rewards in every group."""
    return [float(len(c) % 2 == 0) for c in completions]


def parity_on_odd_answers(prompts, completions, answer, **columns):
    """Varied rewards for prompts with an odd answer, a constant 0 for the others, so that
    dynamic sampling has zero-variance groups to drop."""
    return [float(len(c) % 2 == 0) if int(a) % 2 else 0.0
            for c, a in zip(completions, answer, strict=True)]
