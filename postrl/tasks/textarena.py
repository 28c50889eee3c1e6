"""``textarena:NAME``: TextArena's single-player games (``pip install 'postrl[textarena]'``),
played as postrl episodes with the games unchanged.

NAME is any id of TextArena's registry whose game is played alone: ``GuessTheNumber-v0``,
``Mastermind-v0``, ``FrozenLake-v0``, ``Sudoku-v0-easy``, ``LightsOut-v0``,
``2048-v0-ultra-easy``... A game for two or more players, or one that cannot start here
(Wordle, Hangman and WordLadder need NLTK's word list, TwentyQuestions and GuessWho an
OpenRouter key; Klondike does not import), is a ConfigError naming it.

**Examples.** Game ``s`` is the game TextArena deals with ``reset(num_players=1, seed=s)``, for
``s`` in 0..size-1. Seeds that deal the same start (the same first observation and the same
``game_state``: GuessTheNumber-v0 has only 20 secrets) are kept once, under the first such
seed, and the split is by a stable hash of the start, so no game is in both splits. A game
whose start never changes (TowerOfHanoi, Countdown) has nothing to hold out and is refused;
one whose chance comes after the first move (Minesweeper places its mines then) needs
``distinct_games=false``, which keeps every seed and splits by seed. The games depend only on
NAME and the game's options; ``seed`` only orders ``train()``, as for ``reasoning_gym:NAME``.
The game's constructor parameters are task options too (``task_options.max_number=10`` for
GuessTheNumber), except one named like a postrl option (FrozenLake's ``size``: use a
registered variant instead).

**Turns.** The example's question is the game's first observation: the messages TextArena
sends player 0 after ``reset``, one per line. Each model turn is the action given to the
registered env's ``step``, through the id's action wrappers (most ids wrap an action without
brackets in them, so ``7`` is played as ``[7]``; the ``-raw`` ids have none). The next
observation is the new messages the game sent, without the echo of the model's own action:
the chat already holds it, so TextArena's observation wrappers, which re-render the whole
history for single-prompt agents, are not used. A game that says nothing new is answered
``CONTINUE``. A response that is not a valid move gets the game's own "invalid move" message;
TextArena ends the game after ``error_allowance`` (1) invalid moves in a row.

**Rewards.** TextArena scores a single-player game once, when it ends (``close()``): 1 for a
win, otherwise the game's own partial credit (GuessTheNumber: how close the last guess was,
also when it ends on repeated invalid moves; the library's default for invalid moves is -1).
That number is the reward of the episode's last step and every other step pays 0.0, so the
reward ``environment`` (the sum) is TextArena's reward, and an episode counts as correct
(reward 1.0) exactly when the game was won. With ``partial_credit=false`` a won game pays 1.0
and every other end 0.0. An episode postrl cuts first (``max_turns``, ``max_new_tokens``)
pays 0.0: a game's own turn limit only matters when it is below postrl's.

**Randomness.** TextArena seeds and draws from Python's global generator (Sokoban from
NumPy's). Each episode keeps its own state of both, swapped in around every call into the game
and out again, so an episode replays exactly from its seed whatever else runs, and postrl's own
use of those generators is left as it was (episodes are stepped one at a time, as
``postrl.rollout.episodes`` does; this swap is not thread-safe). What a game prints is dropped.
A game that raises inside ``step`` ends the episode with reward 0.0 and the error as its
observation (logged as a warning), never a crash.
"""

from __future__ import annotations

import difflib
import importlib
import io
import logging
import random
import re
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stdout
from types import ModuleType
from typing import Any

import numpy as np

from postrl.envs.base import Step
from postrl.errors import ConfigError
from postrl.tasks.base import Example, FixedSplits, constructor_options
from postrl.tasks.splits import (
    check_bool,
    check_both_splits,
    check_int,
    check_test_fraction,
    seeded_shuffle,
    split_by_hash,
)

LOG = logging.getLogger(__name__)
# postrl's options; the rest are the game's constructor parameters
OWN_OPTIONS = ("seed", "test_fraction", "size", "partial_credit", "distinct_games")
CONTINUE = "Your move."  # the observation when a game goes on without saying anything new
EXAMPLE_GAMES = ("GuessTheNumber-v0", "Mastermind-v0", "FrozenLake-v0", "Sudoku-v0-easy")
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def import_textarena(game: str) -> ModuleType:
    """``textarena``, or a ConfigError saying which extra to install."""
    try:
        return importlib.import_module("textarena")
    except ImportError as error:
        raise ConfigError(f"task textarena:{game} needs the optional extra: "
                          "pip install 'postrl[textarena]'") from error


def _brief(error: BaseException) -> str:
    """An exception as one short line (NLTK's messages span boxes of asterisks)."""
    text = " ".join(str(error).replace("*", " ").split())
    text = text if len(text) <= 200 else text[:197] + "..."
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def game_class(game: str) -> type:
    """The class registered as TextArena game ``game``; ConfigError with close names."""
    registry = import_textarena(game).envs.registration.ENV_REGISTRY
    if game not in registry:
        close = difflib.get_close_matches(game, sorted(registry), n=5, cutoff=0.6)
        hint = (f"did you mean {', '.join(close)}?" if close
                else f"single-player games include {', '.join(EXAMPLE_GAMES)}")
        raise ConfigError(f"task textarena:{game}: unknown TextArena game '{game}' "
                          f"({len(registry)} registered; {hint})")
    entry_point = registry[game].entry_point
    if not isinstance(entry_point, str):
        return entry_point
    module, _, name = entry_point.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except Exception as error:  # e.g. a SyntaxError in the game's module
        raise ConfigError(f"task textarena:{game}: TextArena's game '{game}' cannot be "
                          f"loaded here: {_brief(error)}") from error


def game_parameters(game: str) -> list[str]:
    """The constructor parameters of game ``game`` a user may set as task options."""
    return constructor_options(game_class(game), OWN_OPTIONS)


def canonical(value: Any, depth: int = 0) -> str:
    """A text for ``value`` that is the same on every run: sets and dicts sorted, objects by
    their attributes (a default ``repr`` holds a memory address)."""
    if depth > 12:
        return type(value).__name__
    if isinstance(value, (str, int, float, bool, type(None))):
        return repr(value)
    if isinstance(value, np.ndarray):  # whose repr elides the middle of a large array
        return canonical(value.tolist(), depth + 1)
    if isinstance(value, dict):
        items = (f"{canonical(k, depth + 1)}:{canonical(v, depth + 1)}" for k, v in value.items())
        return "{" + ",".join(sorted(items)) + "}"
    if isinstance(value, (set, frozenset)):
        return "{" + ",".join(sorted(canonical(v, depth + 1) for v in value)) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(canonical(v, depth + 1) for v in value) + "]"
    if hasattr(value, "__dict__"):
        return type(value).__name__ + canonical(vars(value), depth + 1)
    return _ADDRESS.sub("", repr(value))


class TextArenaGame:
    """One episode: a TextArena game dealt with ``seed``, played by player 0."""

    def __init__(self, game: str, options: dict[str, Any], seed: int,
                 partial_credit: bool = True) -> None:
        self.game, self.seed, self.partial_credit = game, seed, partial_credit
        self.done = False
        self._random: tuple[Any, Any] | None = None  # (Python's, NumPy's) state between calls
        ta = import_textarena(game)
        try:
            with self._own_randomness():
                self.env = ta.make(game, **options)
                self.env.reset(num_players=1, seed=seed)
        except Exception as error:  # a game for more players refuses num_players=1
            what = ("not a single-player game" if "player" in str(error).lower()
                    else f"the game failed to start with options {options}")
            raise ConfigError(f"task textarena:{game}: {what} ({_brief(error)})") from error
        self.base = self.env
        while isinstance(self.base, ta.Wrapper):  # observations come from the game itself
            self.base = self.base.env
        if not isinstance(getattr(self.base, "state", None), ta.SinglePlayerState):
            raise ConfigError(f"task textarena:{game}: not a single-player game")
        self.first_observation = self._observe()

    @contextmanager
    def _own_randomness(self) -> Iterator[None]:
        """Run with this episode's state of the global generators, restoring the caller's after;
        what the game prints is dropped (RushHour reports every puzzle it generates)."""
        outer = random.getstate(), np.random.get_state()
        if self._random is None:
            random.seed(self.seed)
            np.random.seed(self.seed % 2**32)
        else:
            random.setstate(self._random[0])
            np.random.set_state(self._random[1])
        try:
            with redirect_stdout(io.StringIO()):
                yield
        finally:
            self._random = random.getstate(), np.random.get_state()
            random.setstate(outer[0])
            np.random.set_state(outer[1])

    def _observe(self) -> str:
        """The messages the game sent player 0 since the last call, but its own actions."""
        _, messages = self.base.get_observation()
        lines = [text.strip() for _, text, kind in messages
                 if getattr(kind, "name", "") != "PLAYER_ACTION" and text.strip()]
        return "\n".join(lines)

    def fingerprint(self) -> str:
        """What tells two dealt games apart: the first observation and the game's state."""
        return self.first_observation + "\n" + canonical(self.base.state.game_state)

    def step(self, response: str) -> Step:
        """Play ``response`` as player 0's action; the game's reply, or its end and reward."""
        if self.done:
            return Step(done=True)
        try:
            with self._own_randomness():
                done, _ = self.env.step(response)
                observation = self._observe()
                if done:
                    rewards, info = self.env.close()
        except Exception as error:
            self.done = True
            LOG.warning("textarena:%s (seed %d) raised in step: %s", self.game, self.seed,
                        _brief(error))
            return Step(f"The game stopped: {_brief(error)}", reward=0.0, done=True)
        if not done:
            return Step(observation or CONTINUE)
        self.done = True
        reward = float((rewards or {}).get(0, 0.0))
        if not self.partial_credit:
            reward = 1.0 if reward == 1.0 else 0.0
        reason = str((info or {}).get(0, {}).get("reason", ""))
        return Step(reason or observation, reward=reward, done=True)


class TextArenaTask(FixedSplits):
    """Columns: ``ta_game`` (the registry id) and ``ta_seed`` (the seed that deals the game)."""

    default_rewards: tuple[str, ...] = ("environment",)

    def __init__(self, game: str, seed: int = 0, test_fraction: float = 0.2, size: int = 200,
                 partial_credit: bool = True, distinct_games: bool = True,
                 **options: Any) -> None:
        self.game = game
        self.name = f"textarena:{game}"
        self.seed = check_int("seed", seed, 0)
        self.test_fraction = check_test_fraction(test_fraction)
        self.size = check_int("size", size, 2)
        self.partial_credit = check_bool("partial_credit", partial_credit)
        self.distinct_games = check_bool("distinct_games", distinct_games)
        valid = game_parameters(game)
        for option in options:
            if option not in valid:
                raise ConfigError(
                    f"task option '{option}' does not apply to task '{self.name}' "
                    f"(its options: {', '.join([*OWN_OPTIONS, *valid])})")
        self.options = dict(options)
        games = self._deal()
        train, test = split_by_hash(games, self.test_fraction)
        check_both_splits(self.name, train, test)
        self._train = tuple(seeded_shuffle(self._examples(train, "train"), self.seed))
        self._test = tuple(self._examples(test, "test"))

    @staticmethod
    def accepted_options(game: str) -> list[str]:
        """The options of ``textarena:<game>``: postrl's and the game's constructor's."""
        return [*OWN_OPTIONS, *game_parameters(game)]

    def _deal(self) -> list[tuple[str, tuple[int, str]]]:
        """(key, (seed, first observation)) of each game of seeds 0..size-1; the key is the
        game's fingerprint (one seed per distinct start) or, without ``distinct_games``, the
        seed."""
        first = TextArenaGame(self.game, self.options, 0)
        if TextArenaGame(self.game, self.options, 0).fingerprint() != first.fingerprint():
            raise ConfigError(f"task {self.name}: the game is not reproducible from its seed "
                              "(two deals with seed 0 differ), so it cannot be trained on here")
        games: dict[str, tuple[int, str]] = {}
        for env_seed in range(self.size):
            dealt = first if env_seed == 0 else TextArenaGame(self.game, self.options, env_seed)
            key = dealt.fingerprint() if self.distinct_games else f"seed {env_seed}"
            games.setdefault(key, (env_seed, dealt.first_observation))
        if len(games) < 2:
            raise ConfigError(
                f"task {self.name}: seeds 0..{self.size - 1} all deal the same starting game, so "
                "no game can be held out; for a game whose chance comes after the first move "
                "(Minesweeper places its mines then) set task_options.distinct_games=false")
        return list(games.items())

    def _examples(self, games: list[tuple[int, str]], split: str) -> list[Example]:
        return [Example(id=f"{self.name}/{split}/{env_seed}", question=question,
                        columns={"ta_game": self.game, "ta_seed": env_seed})
                for env_seed, question in games]

    def environment(self, example: Example) -> TextArenaGame:
        """A fresh episode of the example's game; its first observation is the question."""
        episode = TextArenaGame(self.game, self.options, int(example.columns["ta_seed"]),
                                self.partial_credit)
        if episode.first_observation != example.question:
            raise RuntimeError(f"{example.id}: textarena:{self.game} dealt a different game "
                               "from the same seed; the game is not reproducible")
        return episode
