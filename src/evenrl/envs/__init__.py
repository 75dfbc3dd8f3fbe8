"""Environments for multi-turn rollouts (rollout.env): the interface a user writes (base: Env, ToolEnv, Step), the
built-in environments and tools, tool calls in the model's own format, the chat-template checks that keep
trajectories token-exact, and the contained runner of environment code (session). docs/multiturn.md.
Torch-free: `evenrl plan` reads the registry and checks templates with it.
"""

from evenrl.envs.base import Env, Step, ToolEnv
from evenrl.envs.registry import ENVS, resolve

__all__ = ["Env", "Step", "ToolEnv", "ENVS", "resolve"]
