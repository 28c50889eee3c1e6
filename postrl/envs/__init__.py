"""Environments: multi-turn episodes in which the model acts and the environment answers."""

from postrl.envs.base import Environment, EnvironmentTask, Step, is_environment_task

__all__ = ["Environment", "EnvironmentTask", "Step", "is_environment_task"]
