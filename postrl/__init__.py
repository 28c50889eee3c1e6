"""postrl: reinforcement-learning post-training of language models as recipes of components."""

from postrl.errors import ConfigError, DataError, PostRLError, RewardError

__version__ = "0.1.0"

__all__ = ["ConfigError", "DataError", "PostRLError", "RewardError", "__version__"]
