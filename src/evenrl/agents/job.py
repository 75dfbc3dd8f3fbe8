"""rollout.agent's user function, run in a reward worker (evenrl.isolation.pool: time, CPU, memory and output caps,
no network; evenrl.isolation.loopback.seal: no Unix socket but the endpoint's): several trajectories' agents at once
on one event loop, each reaching only the endpoint, each under its own time limit, each saying when it returned.
`agent_problem` checks a spec without importing user code (`evenrl plan`).
"""

from __future__ import annotations

import ast
import asyncio
import gc
import importlib
import inspect
import math
import numbers
import socket
import sys
from pathlib import Path

from evenrl.errors import describe_error, shown
from evenrl.isolation.loopback import open_endpoint, seal
from evenrl.rewards.registry import load_named

# How long a worker waits for the endpoint to take an agent's "returned" note (it answers without the rollout).
_NOTE_TIMEOUT_S = 10.0
ALLOWED = "'package.module:function', an async function (row, *, base_url, model, api_key) -> float | None"

# rollout.agent "LIBRARY:TARGET": an environment library's own agent loop run against the endpoint, so environments
# written for verifiers or OpenEnv train as they are (docs/agents.md, "Environments you already have"). Each adapter
# module has `make_agent(target, args) -> async function` (the library imported there, in the worker) and
# `problem(target, args) -> str | None` (torch-free, imports nothing of the user's: `evenrl plan`).
ADAPTERS: dict[str, str] = {"openenv": "evenrl.agents.openenv_adapter",
                            "verifiers": "evenrl.agents.verifiers_adapter"}


def _adapter(spec: str):
    """(the adapter module, its target) when `spec` names an environment library's adapter, else None."""
    library, sep, target = spec.partition(":")
    return (importlib.import_module(ADAPTERS[library]), target) if sep and library in ADAPTERS else None


def allowed(spec: str) -> str:
    """What rollout.agent may be, as a finding's fix says it: the adapter's own form for 'LIBRARY:...'."""
    adapter = _adapter(spec)
    return getattr(adapter[0], "ALLOWED", ALLOWED) if adapter else ALLOWED


def load_agent(spec: str, args: dict | None = None):
    """The async function rollout.agent names (imported: in a worker, or by the trainer's check); `args` are
    rollout.agent_args, for an adapter."""
    adapter = _adapter(spec)
    if adapter:
        module, target = adapter
        return module.make_agent(target, dict(args or {}))
    fn = load_named("rollout.agent", spec, ALLOWED)
    if not inspect.iscoroutinefunction(fn):
        what = "nothing" if fn is None else f"a {type(fn).__name__}, not an async function"
        raise TypeError(f"rollout.agent {spec}: names {what}; expected {ALLOWED}")
    return fn


class AgentRunner:
    """rollout.agent's function as the pool calls it: pickled as its spec, and imported when a worker unpickles it,
    so that importing the user's module (openai and the rest: seconds) counts against the worker's load time, not
    against the agents' own time limit."""

    def __init__(self, spec: str, args: dict | None = None):
        self.spec, self.args, self.fn = spec, dict(args or {}), None

    def __getstate__(self):
        return {"spec": self.spec, "args": self.args}

    def __setstate__(self, state):
        self.spec, self.args = state["spec"], state["args"]
        seal()  # before the module's own code runs: a thread it starts on import is held by the filter too
        self.fn = load_agent(self.spec, self.args)

    def __call__(self, socket_path: str, items: list[tuple[str, dict]], model: str,
                 timeout_s: float) -> list[tuple[str, object]]:
        """(In a worker) the agent on each (trajectory token, row), concurrently: per item ("ok", reward or None)
        or (failure kind, one-line message). Each agent gets base_url http://127.0.0.1:PORT/t/TOKEN/v1, its own."""
        port = open_endpoint(socket_path)
        fn = self.fn or load_agent(self.spec, self.args)

        async def one(token: str, row: dict) -> tuple[str, object]:
            try:
                return await timed(token, row)
            finally:
                _say_returned(port, token)

        async def timed(token: str, row: dict) -> tuple[str, object]:
            try:
                value = await asyncio.wait_for(
                    fn(dict(row), base_url=f"http://127.0.0.1:{port}/t/{token}/v1", model=model, api_key=token),
                    timeout_s)
            except asyncio.TimeoutError:
                return "timeout", f"the agent took longer than {timeout_s:g} s (rollout.agent_timeout_s)"
            except MemoryError as e:
                return "memory", f"the agent ran out of memory ({describe_error(e)})"
            except Exception as e:
                return "raised", f"the agent raised {describe_error(e)}"
            if value is None:
                return "ok", None
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                return "bad_value", f"the agent returned {value!r:.60}; expected a finite number or None"
            return "ok", float(value)

        async def every():
            out = await asyncio.gather(*(one(token, row) for token, row in items))
            # an agent that raised (rollout.partial's cut calls are refused) leaves its HTTP client in a reference
            # cycle: collected here, its close runs on this loop, not on a later step's (which reports it closed)
            gc.collect()
            await asyncio.sleep(0.01)
            return out
        return asyncio.run(every())


def _say_returned(port: int, token: str) -> None:
    """Tell the endpoint that this trajectory's agent returned, blocking the event loop for that round trip (the
    endpoint answers at once): no task the agent left running gets a turn before, so its later calls are refused,
    never recorded. Where the endpoint cannot be reached, the rollout is over and nothing more is recorded anyway."""
    note = f"POST /t/{token}/returned HTTP/1.1\r\nhost: evenrl\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=_NOTE_TIMEOUT_S) as conn:
            conn.sendall(note.encode())
            conn.recv(64)  # the status line: the endpoint has taken the note
    except OSError:
        pass


def agent_problem(spec: str, args: dict | None = None) -> str | None:
    """Why rollout.agent `spec` (with rollout.agent_args `args`) cannot run, as far as reading files tells (no user
    code imported): its module is found on sys.path and defines the function with `async def` at top level, or the
    adapter it names says; None if it may work."""
    adapter = _adapter(spec)
    if adapter:
        module, target = adapter
        return module.problem(target, dict(args or {}))
    if args:
        return (f"is a function, and rollout.agent_args ({', '.join(sorted(args))}) are for an environment library's "
                f"adapter ({', '.join(f'{k}:...' for k in ADAPTERS)})")
    module, sep, name = spec.partition(":")
    if not (sep and module and name) or not all(p.isidentifier() for p in module.split(".")):
        return f"is not {ALLOWED}"
    read = module_tree(module)
    if isinstance(read, str):
        return read
    source, tree = read
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            if isinstance(node, ast.FunctionDef):
                return f"{source}: {name} is a plain function; declare it `async def` (agents await their calls)"
            return None
        if isinstance(node, (ast.Assign, ast.ImportFrom, ast.Import)) and name in ast.unparse(node):
            return None  # defined by assignment or imported: only the trainer can tell
    return f"{source} defines no function {name!r} at top level"


def module_tree(module: str) -> tuple[Path, ast.Module] | str:
    """(its file, its syntax tree) of `module`, found on sys.path and parsed, never imported; or why not, as a
    finding's line says it."""
    source = _module_file(module)
    if source is None:
        return f"names module {shown(module, 50)}, which is not on the Python path here (PYTHONPATH?)"
    try:
        return source, ast.parse(source.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError) as e:
        return f"cannot read {source} ({describe_error(e)})"


def _module_file(module: str) -> Path | None:
    parts = module.split(".")
    for root in sys.path:
        base = Path(root or ".").joinpath(*parts)
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
    return None
