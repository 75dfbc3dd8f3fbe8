"""The trajectory-loop protocol: what the step, the reserved rollout ranks, evaluation and partial rollouts ask of a
run's trajectory loop, whichever makes the trajectories: rollout.env's turn loop (evenrl.rollout.trajectories.Turns)
or rollout.agent's agents (evenrl.agents.rollout.Agents, which sits below this package and satisfies it by shape).
evenrl.rollout.trajectories.make_turns gives the run's one, or None for one completion per prompt.
"""

from __future__ import annotations

from typing import Protocol

from evenrl.core.carry import CarryRules
from evenrl.engines.base import Engine, Request, SamplingParams, Trajectory


class TrajectorySource(Protocol):
    def load(self, tokenizer, path: str | None = None) -> tuple[list[dict], list[list[int]], list[list[dict]], int]:
        """(rows, prompt tokens, opening messages, rows skipped as longer than data.max_prompt_tokens) of data.path
        (or `path`); the source keeps `tokenizer` for its rollouts."""
        ...

    def generate(self, engine: Engine, requests: list[Request], params: SamplingParams, *, rows: list[dict],
                 openings: list[list[dict]]) -> list[list[Trajectory]]:
        """Engine.generate's [request][sample] result as whole trajectories (`rows`, `openings`: each request's
        dataset row and opening messages)."""
        ...

    def advance(self, engine: Engine, prompts, records: list, ages: list[int], rules: CarryRules,
                params: SamplingParams, version: int) -> list[bool]:
        """One step of rollout.partial for these carried trajectories (evenrl.rollout.carry.Carried; talk None for a
        new one) under policy `version`, each at its age: their tokens, log-probs, versions and talk set in place.
        Returns per record whether its trajectory is complete. `prompts`: evenrl.train.trainer.Prompts."""
        ...
