"""rollout.agent "openenv:package.module:EnvClass": an OpenEnv environment (openenv-core >= 0.3, Meta's) trained as it
is written. Per trajectory, in the contained worker (evenrl.agents.job), the class is instantiated in-process
with rollout.agent_args (no docker, no environment server) and one episode is driven by OpenEnv's own harness:
`MCPHarnessAdapter.run_white_box` with `build_model_step` over OpenEnv's `OpenAIClient` pointed at evenrl's
endpoint, the environment seen through OpenEnv's `StepEnvSessionAdapter` (tools listed with `ListToolsAction`, each
model tool call one `CallToolAction` step). The reward is the environment's own, resolved as OpenEnv resolves it
for TRL (the last tool result that carries one, checked against the final step's); an episode that earned none
returns None (rewards.functions score the last reply). docs/agents.md, "Environments you already have".

Only MCPEnvironment subclasses: OpenEnv's harness drives tools, and an environment with typed free-form actions
names no tool and no text for its observations, so any mapping would be evenrl's invention, not the environment's.
"""

from __future__ import annotations

import ast
import asyncio
import functools
import hashlib
import importlib
import inspect
import json
import threading
import warnings
from pathlib import Path

from evenrl.agents.job import module_tree
from evenrl.rewards.registry import findable

ALLOWED = "'openenv:package.module:EnvClass', an OpenEnv MCPEnvironment subclass (its MCP tools are the model's)"
INSTALL = "pip install -e '.[environments]'"
# Row fields that name the episode for OpenEnv itself (reset's own parameters), never passed twice.
_RESET_OWN = ("seed", "episode_id")


def episode_seed(row: dict) -> int:
    """The seed an episode is reset with when its row has no integer `seed`: from the row's content alone (never
    time or process), so 1 or N processes, and every sample of a prompt, see the same episode. 32 bits: numpy's
    legacy seeding takes no more."""
    text = json.dumps(row, sort_keys=True, default=str, ensure_ascii=False)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=4).digest(), "big")


def reset_arguments(reset, row: dict) -> tuple[int, str, dict]:
    """(seed, episode_id, keyword arguments) of the episode's `reset`: the row's `seed` if it is an integer, else
    episode_seed(row); its `episode_id` if given, else the seed in hex; and the row's other fields, all of them if
    reset takes **kwargs, else those it names (as TRL passes dataset columns to an environment's reset)."""
    seed = row.get("seed")
    seed = seed if isinstance(seed, int) and not isinstance(seed, bool) else episode_seed(row)
    episode_id = str(row.get("episode_id") or f"{seed:08x}")
    params = inspect.signature(reset).parameters
    every = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    fields = {k: v for k, v in row.items() if k not in _RESET_OWN and (every or k in params)}
    return seed, episode_id, fields


def opening(row: dict) -> list[dict]:
    """The conversation an episode starts from: the row's prompt, a string as one user message or a list of OpenAI
    messages as it is (OpenEnv observations carry no standard text; the dataset gives the task, as TRL's does)."""
    prompt = row.get("prompt", "")
    return [dict(m) for m in prompt] if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]


def tool_text(observation) -> str:
    """What the model reads back from one CallToolAction: the tool's text content, its data as JSON where it has no
    text, or the error OpenEnv reports (unknown tool, bad arguments, timeout)."""
    error = getattr(observation, "error", None)
    if error is not None:
        return f"error: {getattr(error, 'message', error)}"
    result = getattr(observation, "result", None)
    texts = [c.text for c in getattr(result, "content", None) or [] if isinstance(getattr(c, "text", None), str)]
    if texts:
        return "\n".join(texts)
    data = getattr(result, "data", result)
    return data if isinstance(data, str) else json.dumps(data, sort_keys=True, default=str)


def make_agent(target: str, args: dict):
    """The async agent function for rollout.agent 'openenv:TARGET' (imported in the worker: openenv, the user's
    module)."""
    from openenv.core.env_server.mcp_environment import MCPEnvironment

    # openenv 0.3 reads a field fastmcp renamed: a warning per worker that its users cannot act on
    warnings.filterwarnings("ignore", r"Accessing `Tool\.inputSchema` is deprecated",
                            module=r"openenv\.core\.env_server\.mcp_environment")
    module, _, name = target.partition(":")
    env_class = getattr(importlib.import_module(module), name, None)
    if not (isinstance(env_class, type) and issubclass(env_class, MCPEnvironment)):
        what = "nothing" if env_class is None else getattr(env_class, "__name__", type(env_class).__name__)
        raise TypeError(f"rollout.agent openenv:{target}: names {what}, not a subclass of openenv's MCPEnvironment; "
                        f"expected {ALLOWED}")

    async def agent(row, *, base_url, model, api_key):
        # OpenEnv's harness, its model step and its environments are synchronous (each runs its coroutines on a
        # loop of its own): the episode runs in a thread of its own, and its model calls on this worker's loop, which
        # the other agents share. A thread per episode, not a pool: a pool would queue episodes whose time runs.
        loop = asyncio.get_running_loop()
        done, llm = loop.create_future(), endpoint_client(loop, base_url, model, api_key)

        def settle(outcome, value):
            if not done.done():  # the agent's timeout may have cancelled it
                (done.set_result if outcome else done.set_exception)(value)

        def run():
            try:
                outcome = True, run_episode(env_class, args, dict(row), llm)
            except BaseException as e:
                outcome = False, e
            try:
                loop.call_soon_threadsafe(settle, *outcome)
            except RuntimeError:  # the worker's loop is gone: the agent timed out and its job ended without it
                pass
        threading.Thread(target=run, name="evenrl-openenv-episode", daemon=True).start()
        try:
            return await done
        finally:  # on this loop: a client closed by the garbage collector on a later step's loop fails noisily
            await llm.aclose()
    return agent


def run_episode(env_class, args: dict, row: dict, llm) -> float | None:
    """One episode of `env_class(**args)` on `row`, the model reached through `llm` (an OpenEnv LLMClient): the
    environment's reward, or None if it gave none."""
    from openenv.core.client_types import StepResult
    from openenv.core.env_server.mcp_types import CallToolAction, ListToolsAction
    from openenv.core.harness import (HarnessRunLimits, MCPHarnessAdapter, StepEnvSessionAdapter, ToolResult,
                                      _resolve_env_reward)
    from openenv.core.harness.collect import build_model_step

    class InProcess:
        """The environment as the step/reset/state client StepEnvSessionAdapter drives (what an EnvClient is to
        a remote server): observations wrapped as StepResults, in this process."""

        def __init__(self, env):
            self.env = env

        def reset(self, **kwargs):
            return self._result(self.env.reset(**kwargs))

        def step(self, action):
            return self._result(self.env.step(action))

        def state(self):
            return self.env.state

        def close(self):
            self.env.close()

        @staticmethod
        def _result(obs):
            return StepResult(observation=obs, reward=obs.reward, done=bool(obs.done))

    def tool_result(name, arguments, result, state):
        return ToolResult(data=tool_text(result.observation), done=result.done, metadata={"reward": result.reward})

    env = env_class(**args)
    try:  # tools listed before reset (StepEnvSessionAdapter resets), so an environment counting steps counts none
        tools = env.step(ListToolsAction()).tools
        seed, episode_id, fields = reset_arguments(env.reset, row)
    except BaseException:
        env.close()
        raise
    session = StepEnvSessionAdapter(
        InProcess(env), task=row, seed=seed, episode_id=episode_id, tool_specs=tools,
        action_builder=lambda name, arguments: CallToolAction(tool_name=name, arguments=arguments),
        initial_messages_builder=lambda result, task: opening(task), tool_result_builder=tool_result,
        reset_kwargs=fields)
    try:
        rollout = MCPHarnessAdapter().run_white_box(build_model_step(llm), session, HarnessRunLimits())
        verify = session.verify(rollout.messages, final_state={"done": rollout.done, "metrics": rollout.metrics})
    finally:
        session.close()
    if verify.env_reward is None and all(e.result.metadata.get("reward") is None for e in rollout.tool_trace):
        return None
    return _resolve_env_reward(rollout, verify)


@functools.cache
def _endpoint_class():
    from openenv.core.llm_client import OpenAIClient

    class Endpoint(OpenAIClient):
        """OpenEnv's OpenAIClient on evenrl's endpoint: its base_url (OpenAIClient builds one from host and port and
        appends /v1; the endpoint's has a path), and every call made on the worker's loop, so all of a worker's
        requests share one loop whatever thread the harness runs on."""

        def __init__(self, loop, base_url: str, model: str, api_key: str):
            self._url, self._loop = base_url.removesuffix("/").removesuffix("/v1"), loop
            super().__init__("", 0, model=model, api_key=api_key)

        @property
        def base_url(self) -> str:
            return self._url

        async def aclose(self):
            await self._client.close()

        async def complete_with_tools(self, messages, tools, **kwargs):
            call = OpenAIClient.complete_with_tools(self, messages, tools, **kwargs)
            return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(call, self._loop))
    return Endpoint


def endpoint_client(loop, base_url: str, model: str, api_key: str):
    """OpenEnv's OpenAIClient on evenrl's endpoint `base_url`, its calls made on `loop`."""
    return _endpoint_class()(loop, base_url, model, api_key)


def problem(target: str, args: dict) -> str | None:
    """Why rollout.agent 'openenv:TARGET' with rollout.agent_args `args` cannot run, read from files (neither
    openenv nor the user's module imported): None if it may."""
    module, sep, name = target.partition(":")
    if not (sep and module and name.isidentifier() and all(p.isidentifier() for p in module.split("."))):
        return f"is not {ALLOWED}"
    if not findable("openenv"):
        return f"needs openenv-core, which is not installed here: {INSTALL}"
    try:
        json.dumps(args, allow_nan=False)
    except (TypeError, ValueError) as e:
        return f"has rollout.agent_args that are not JSON values ({e}); they are {name}'s keyword arguments"
    read = module_tree(module)
    if isinstance(read, str):
        return read
    source, tree = read
    where = _shown(source)
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    if name not in classes:
        if any(isinstance(n, (ast.Assign, ast.ImportFrom, ast.Import)) and name in ast.unparse(n) for n in tree.body):
            return None  # re-exported (OpenEnv's packages export their server's class): the worker checks it
        return f"{where} defines no class {name!r} at top level"
    if _kind(classes, name, set()) == "plain":
        return (f"{where}: {name} is an OpenEnv Environment with typed actions; only MCPEnvironment subclasses "
                "(tools the model calls) are supported: expose its actions as MCP tools")
    init = next((n for n in classes[name].body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
    if init is not None and init.args.kwarg is None:
        unknown = sorted(set(args) - {a.arg for a in init.args.args[1:] + init.args.kwonlyargs})
        if unknown:
            return f"{where}: {name}.__init__ takes no argument {unknown[0]!r} (rollout.agent_args)"
    return None


def _shown(path) -> str:
    """A file as a finding names it: relative to the working directory when under it (the plan's lines stay the
    same on every checkout)."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def _kind(classes: dict, name: str, seen: set) -> str:
    """'mcp', 'plain' (only openenv's Environment among its bases) or 'unknown' (bases from elsewhere: the worker
    checks), following bases defined in the same file."""
    seen.add(name)
    kinds = []
    for base in classes[name].bases:
        base_name = ast.unparse(base).split("[")[0].rsplit(".", 1)[-1]
        if base_name == "MCPEnvironment":
            return "mcp"
        if base_name in classes and base_name not in seen:
            kinds.append(_kind(classes, base_name, seen))
        else:
            kinds.append("plain" if base_name == "Environment" else "unknown")
    if "mcp" in kinds:
        return "mcp"
    return "plain" if kinds and all(k == "plain" for k in kinds) else "unknown"
