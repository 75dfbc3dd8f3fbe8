"""rollout.agent "verifiers:ENV_ID": an environment written for Prime Intellect's `verifiers` (0.4, `verifiers.v1`)
trained as it is. ENV_ID is what `eval ENV_ID` and prime-rl's `env.taskset.id` take (a taskset module on the Python
path, or a built-in one); rollout.agent_args are the environment's config (`[env]` of a verifiers TOML: `taskset`
options, `id` of a multi-agent Env class, each role's settings), passed to `verifiers.v1.resolve_env_config`.

How a rollout runs: as prime-rl's env server runs one (verifiers/v1/serve/server.py `EnvServer`). Once per worker
the environment is loaded (`load_environment`); per row the task is rebuilt from its data (`TaskData.model_validate`
into the taskset's Task class, with the config's task settings) and played as one episode (`Env.run_slot`) under
`Env.serving()` (its interception server, and the taskset's tool servers, on the worker's own loopback), with a
`ModelContext` whose client is an `EvalClientConfig` at evenrl's endpoint. The reward is the episode's trace's own:
its rubric (`@vf.reward` functions and plugged rewards, weighted), never rewards.functions.

- Tokens: the plain chat-completions client (`eval`), which relays each request to the endpoint as the harness
  sent it. Its `train` client (TrainClientConfig) would tokenise on verifiers' side with `renderers` and call a vLLM
  `/inference/v1/generate` route; evenrl serves neither, and its trajectories are the endpoint's own record.
- Where it runs: evenrl's agent workers have no network (docs/agents.md), so every role runs the `null` harness
  (verifiers' tool-less chat program; the taskset's MCP toolsets still reach it) in the `subprocess` runtime, the
  defaults here and the only values allowed: verifiers' own defaults are a `prime` sandbox (remote) and the `bash`
  harness (model-written shell commands on the host). That program is a PEP 723 script verifiers prepares with
  `uv sync` (a download); here its environment is this Python's (which has its dependencies, verifiers' own), by
  recording the interpreter in the cache verifiers keeps after a `uv sync` (`_offline_chat_program`). The client's key
  variable is not PRIME_API_KEY, so the Prime CLI config is never read; no tunnel is opened (a local runtime needs
  none); nothing is reported to Prime's platform (that is the `eval` command's, not `Env.run_slot`'s).
- Data: the environment's taskset is the data, as prime-rl users expect, written once to a JSONL file that
  data.path reads: `export_tasks` (docs/agents.md has the command). A row is {"prompt": the task's prompt (what
  evenrl weighs, filters and keys), "answer": its answer if it has one, "task": the task's data as the taskset built
  it}; config `data.extra_fields: [task]`. The task is rebuilt from "task" alone, as prime-rl's orchestrator ships
  `task_data` to the env server: whatever a Task needs travels whole, nothing is re-derived from evenrl's columns.
  One file rather than loading the taskset in the trainer: evenrl's layout (keys by prompt and sample, the plan's
  lengths) is computed from data.path before anything is imported, and stays so.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import copy
import hashlib
import importlib.util
import json
import os
import re
import sys
from pathlib import Path

from evenrl.agents.job import module_tree
from evenrl.errors import shown
from evenrl.rewards.registry import findable

PIP = "pip install -e '.[environments]'"
ALLOWED = "'verifiers:ENV_ID', a verifiers taskset on the Python path"
# The environment variable verifiers' client reads its key from: not PRIME_API_KEY, whose presence makes verifiers
# read the Prime CLI config. Unset: the client sends "EMPTY"; the endpoint knows the trajectory by its URL.
API_KEY_VAR = "EVENRL_VERIFIERS_API_KEY"
RUNTIME, HARNESS = "subprocess", "null"

_ENVS: dict[str, object] = {}  # (ENV_ID, agent_args) as JSON -> the loaded Env, once per worker
_HELD: dict[int, _Held] = {}  # id(env) -> its serving context on the running event loop


def problem(target: str, args: dict) -> str | None:
    """Why rollout.agent "verifiers:TARGET" with rollout.agent_args `args` cannot run, read from files only (neither
    verifiers nor the environment's module is imported); None if it may work."""
    try:
        json.dumps(args)
    except (TypeError, ValueError) as e:
        return f"with rollout.agent_args that are not JSON ({type(e).__name__}): they are the environment's config"
    try:
        spec = importlib.util.find_spec("verifiers")
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        return f"needs the verifiers package, which is not installed here ({PIP})"
    module = _module_name(target)
    if not module.isidentifier():
        return "names no environment (verifiers:ENV_ID)"
    if not (_builtin(spec, module) or findable(module)):
        return f"names no module {shown(module, 30)} on the Python path nor a verifiers taskset (PYTHONPATH?)"
    if not _builtin(spec, module) and (why := _older_api(module)):
        return why
    taskset = args.get("taskset", {})
    if not isinstance(taskset, dict) or taskset.get("id", target) != target:
        return f"with rollout.agent_args taskset {shown(taskset, 30)}: its id must be the ENV_ID"
    for role, settings in args.items():
        if isinstance(settings, dict) and (why := _role_problem(role, settings)):
            return why
    return None


def make_agent(target: str, args: dict):
    """(In a worker) the agent function for environment `target`, loaded once per worker and kept."""
    env = _load(target, args)

    async def rollout(row: dict, *, base_url: str, model: str, api_key: str) -> float:
        return await _episode(env, row, base_url, model)
    return rollout


def export_tasks(env_id: str, path: str, args: dict | None = None, limit: int | None = None) -> int:
    """Write the tasks of verifiers environment `env_id` (its taskset with rollout.agent_args `args`) to the JSONL
    file `path` as data.path rows (the module docstring says what a row holds); the first `limit` of them if given
    (an infinite taskset needs it). Returns how many."""
    import verifiers.v1 as vf

    settings = dict((args or {}).get("taskset", {}), id=env_id)
    taskset = vf.load_taskset(vf.taskset_config_type(env_id).model_validate(settings))
    if type(taskset).INFINITE and limit is None:
        raise ValueError(f"{env_id}: the taskset is infinite; give limit=N")
    rows = []
    for n, task in enumerate(taskset):
        if limit is not None and n >= limit:
            break
        data = task.data.model_dump(mode="json", exclude_defaults=True)
        prompt = task.data.model_dump(mode="json")["prompt"]
        rows.append({"prompt": prompt or "", "answer": data.get("answer"), "task": data})
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    return len(rows)


def _module_name(env_id: str) -> str:
    """The module verifiers imports for `env_id` (verifiers/v1/utils/loaders.py `_import_plugin`): a Hub id's
    owner/ and @version dropped, dashes as underscores, lower case."""
    return env_id.rsplit("/", 1)[-1].split("@", 1)[0].replace("-", "_").lower()


def _builtin(spec, module: str) -> bool:
    """Whether verifiers ships taskset `module` (verifiers.v1.tasksets), found by its files."""
    return any((Path(root) / "v1" / "tasksets" / module).with_suffix(".py").is_file()
               or (Path(root) / "v1" / "tasksets" / module / "__init__.py").is_file()
               for root in spec.submodule_search_locations or ())


def _older_api(module: str) -> str | None:
    """Why `module`, read and never imported, is not a verifiers 0.4 taskset: verifiers.v1 loads the Taskset subclass
    a taskset module exports through `__all__` (v1/utils/loaders.py `_plugin_class`), and an environment written for
    an older verifiers (`load_environment()`, no `__all__`) fails that in every worker, every trajectory alike."""
    read = module_tree(module)
    if isinstance(read, str):  # not a plain source file (an installed build): verifiers finds out in the worker
        return None
    source, tree = read
    names = {t.id for node in tree.body if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign))
             for t in (node.targets if isinstance(node, ast.Assign) else [node.target]) if isinstance(t, ast.Name)}
    if "__all__" in names:
        return None
    older = any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == "load_environment"
                for n in tree.body)
    return (f"names module {shown(module, 30)} ({source.name}), which exports no Taskset subclass through __all__ "
            "(what verifiers 0.4 loads)" + ("; its load_environment() is an older verifiers API's" if older else ""))


def _role_problem(role: str, settings: dict) -> str | None:
    """Why a role's settings in rollout.agent_args cannot run in evenrl's workers, if they name a runtime or a harness."""
    runtime, harness = settings.get("runtime"), settings.get("harness")
    kind = runtime.get("type") if isinstance(runtime, dict) else None
    if kind not in (None, RUNTIME):
        return (f"with rollout.agent_args {shown(role, 20)[1:-1]}.runtime.type {shown(kind, 30)}: only {RUNTIME!r} "
                "runs in the workers")
    name = harness.get("id") if isinstance(harness, dict) else None
    if name not in (None, HARNESS):
        return (f"with rollout.agent_args {shown(role, 20)[1:-1]}.harness.id {shown(name, 30)}: only {HARNESS!r} (the "
                "chat program) runs in the workers")
    return None


def _load(target: str, args: dict):
    key = json.dumps([target, args], sort_keys=True)
    if key not in _ENVS:
        import verifiers.v1 as vf

        _offline_chat_program()
        settings = copy.deepcopy(args)
        settings["taskset"] = dict(settings.get("taskset", {}), id=target)
        config_type = vf.env_config_type(target, settings.get("id", ""))
        for role, field in config_type.model_fields.items():
            if isinstance(field.default, vf.AgentConfig):
                own = settings.setdefault(role, {})
                own.setdefault("runtime", {"type": RUNTIME})
                own.setdefault("harness", {"id": HARNESS})
                if why := _role_problem(role, own):
                    raise ValueError(f"verifiers:{target} {why}")
        _ENVS[key] = vf.load_environment(vf.resolve_env_config(settings))
    return _ENVS[key]


def _offline_chat_program() -> None:
    """Let the `null` harness's program run on this Python: verifiers runs it with the interpreter `uv sync --script`
    prepared for it (runtimes/base.py `prepare_uv_script`), cached per script path; that download cannot happen in a
    worker without network. Its dependencies are verifiers' own, installed here: checked, then this interpreter is
    recorded for the script, which is written where verifiers keeps it."""
    from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE
    from verifiers.v1.runtimes.subprocess import SubprocessRuntime

    header = re.search(r"^# dependencies = \[(.*)\]$", CHAT_PROGRAM_SOURCE, re.M)
    for dep in re.findall(r'"([A-Za-z0-9_.\-]+)', header.group(1) if header else ""):
        if importlib.util.find_spec(dep.replace("-", "_")) is None:
            raise ModuleNotFoundError(f"the null harness's program needs {dep}, not installed here ({PIP})")
    source = CHAT_PROGRAM_SOURCE.encode()
    path = Path(SubprocessRuntime.scripts_dir) / f"{hashlib.sha256(source).hexdigest()}.py"
    if not (path.is_file() and path.read_bytes() == source):
        path.parent.mkdir(parents=True, exist_ok=True)
        staged = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        staged.write_bytes(source)
        os.replace(staged, path)  # several workers may write it at once
    SubprocessRuntime._interpreters[str(path)] = sys.executable


async def _episode(env, row: dict, base_url: str, model: str) -> float:
    """One episode of the row's task against the endpoint: the episode's reward, or an exception saying why not."""
    import verifiers.v1 as vf

    if not isinstance(row.get("task"), dict):
        raise ValueError("the row has no 'task' object (the task's data): write data.path with "
                         "evenrl.agents.verifiers_adapter.export_tasks and set data.extra_fields: [task]")
    task_type = type(env.taskset).task_type()
    task = task_type(task_type.data_type().model_validate(row["task"]), env.config.taskset.task)
    ctx = vf.ModelContext(client=vf.EvalClientConfig(base_url=base_url, api_key_var=API_KEY_VAR), model=model,
                          sampling=vf.SamplingConfig())
    async with _serving(env):
        (slot,) = env.slots(task)
        episode = await env.run_slot(slot, ctx)
    errors = [*episode.errors, *(e for t in episode.traces for e in t.errors)]
    if errors or not episode.ok:
        error = errors[-1] if errors else None
        raise RuntimeError(f"the episode failed: {error.type}: {error.message}" if error else "the episode failed")
    if len(episode.traces) != 1:
        raise RuntimeError(f"the episode ran {len(episode.traces)} agents; evenrl trains one trajectory per episode "
                           "(every call through the endpoint is one agent's)")
    return float(episode.traces[0].reward)


class _Held:
    """Env.serving() (the interception server, shared tool servers) held on one event loop while rollouts use it:
    entered by a task of its own, left when the last rollout is done. One at a time per Env: serving() keeps its
    resources on the Env object, so two overlapping would overwrite each other's."""

    def __init__(self, env):
        self.loop = asyncio.get_running_loop()
        self.users, self.ready, self.done = 0, self.loop.create_future(), asyncio.Event()
        self.task = self.loop.create_task(self._hold(env))

    async def _hold(self, env) -> None:
        try:
            async with env.serving():
                self.ready.set_result(None)
                await self.done.wait()
        except BaseException as e:
            if not self.ready.done():
                self.ready.set_exception(e)
            raise
        finally:
            if _HELD.get(id(env)) is self:
                del _HELD[id(env)]


@contextlib.asynccontextmanager
async def _serving(env):
    while True:
        held = _HELD.get(id(env))
        if held is None or held.loop is not asyncio.get_running_loop():
            held = _HELD[id(env)] = _Held(env)  # a previous loop's is gone with its loop
        if not held.done.is_set():
            break
        await asyncio.wait([held.task])  # the last user left: its teardown first
    held.users += 1
    try:
        await asyncio.shield(held.ready)
        yield
    finally:
        held.users -= 1
        if held.users == 0:
            held.done.set()
            await asyncio.wait([held.task])
