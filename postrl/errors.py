"""Errors a user can act on.

Every error names what is wrong and where: the option, the file and line, or the sample id.
The CLI prints these without a traceback; anything else is a bug in postrl.
"""


class PostRLError(Exception):
    """Base class for errors caused by the user's input, printed without a traceback."""


class ConfigError(PostRLError):
    """An option, recipe override or combination of options is invalid."""


class DataError(PostRLError):
    """A data file or sample is malformed (the message names file:line or sample id)."""


class RewardError(PostRLError):
    """A reward function failed or returned something unusable."""
