"""An OpenEnv environment as OpenEnv users write them (an MCPEnvironment with FastMCP tools), trained by evenrl as it
stands: rollout.agent=openenv:arith_env:ArithmeticEnv with examples/ on PYTHONPATH (docs/agents.md).

Two tools: `calculator` (exact arithmetic, no reward) and `submit_answer` (reward 1.0 if it equals the row's answer,
else 0.0; ends the episode). reset() receives the dataset row's fields, so the row picks the episode."""

import ast
import operator
from fractions import Fraction

from fastmcp import FastMCP
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.mcp_types import CallToolAction
from openenv.core.env_server.types import Observation, State

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def _value(node):
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_value(node.operand)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_value(node.left), _value(node.right))
    raise ValueError("only integers with + - * / and parentheses")


class ArithmeticEnv(MCPEnvironment):
    def __init__(self, max_steps: int = 4):
        mcp = FastMCP("arithmetic")

        @mcp.tool
        def calculator(expression: str) -> str:
            """Evaluate an arithmetic expression exactly.

            Args:
                expression: integers with + - * / and parentheses, e.g. "(12 + 30) * 2"
            """
            try:
                value = _value(ast.parse(expression.strip()[:200], mode="eval").body)
            except (SyntaxError, ValueError, ZeroDivisionError, RecursionError) as e:
                return f"error: {e}"
            return str(value.numerator) if value.denominator == 1 else str(value)

        @mcp.tool
        def submit_answer(answer: str) -> str:
            """Submit the final answer; this ends the episode.

            Args:
                answer: the number, e.g. "42"
            """
            return f"submitted {answer}"

        super().__init__(mcp)
        self.max_steps = max_steps
        self._state, self._answer = State(), ""

    def reset(self, seed=None, episode_id=None, answer="", **row) -> Observation:
        self._state, self._answer = State(episode_id=episode_id, step_count=0), str(answer).strip()
        return Observation(done=False, reward=None)

    def step(self, action, timeout_s=None, **kwargs) -> Observation:
        self._state.step_count += 1
        obs = super().step(action, timeout_s=timeout_s, **kwargs)
        if isinstance(action, CallToolAction) and action.tool_name == "submit_answer":
            obs.reward = float(str(action.arguments.get("answer", "")).strip() == self._answer)
            obs.done = True
        elif self._state.step_count >= self.max_steps:
            obs.reward, obs.done = 0.0, True  # out of steps without an answer
        return obs

    def _step_impl(self, action, timeout_s=None, **kwargs) -> Observation:
        return Observation(done=False, reward=None, metadata={"error": "use the calculator or submit_answer tools"})

    @property
    def state(self) -> State:
        return self._state
