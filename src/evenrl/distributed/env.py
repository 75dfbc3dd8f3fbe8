"""The launch environment of this process: what torchrun or Slurm told it. Pure Python, never imports torch:
the planner (`evenrl plan`), the launcher (`evenrl.train.launch`) and `evenrl.distributed.collectives.init` all
read it here, by the same rules.

    read_env(os.environ) -> LaunchEnv(source="slurm", rank=9, world=16, local_rank=1, local_world=8, ...)

First match wins:
  * torchrun / elastic, when WORLD_SIZE is set with RANK or LOCAL_WORLD_SIZE: RANK (default 0), WORLD_SIZE,
    LOCAL_WORLD_SIZE (default WORLD_SIZE), LOCAL_RANK (default RANK % LOCAL_WORLD_SIZE), GROUP_RANK (default
    RANK // LOCAL_WORLD_SIZE), nnodes = WORLD_SIZE // LOCAL_WORLD_SIZE (at least 1), MASTER_ADDR (default
    127.0.0.1), MASTER_PORT (default 29500), restarts TORCHELASTIC_RESTART_COUNT. torchrun inside a Slurm
    allocation is torchrun: its variables win over Slurm's.
  * Slurm, when SLURM_PROCID is set (an srun task) or SLURM_JOB_ID with SLURM_NNODES (a shell or batch script in
    an allocation):
      rank        SLURM_PROCID (default 0)
      world       SLURM_STEP_NUM_TASKS, else SLURM_NTASKS, else the sum of the tasks-per-node list below, else
                  one task per node (what srun starts by default)
      local_rank  SLURM_LOCALID (default 0); node_rank SLURM_NODEID (default 0)
      nnodes      SLURM_STEP_NUM_NODES, else SLURM_NNODES, else the length of the tasks-per-node list, else 1
      local_world this node's entry of the first of SLURM_STEP_TASKS_PER_NODE / SLURM_TASKS_PER_NODE /
                  SLURM_NTASKS_PER_NODE ('2(x3),1' -> 2, 2, 2, 1; past the end: the last), else world // nnodes
      master      MASTER_ADDR, else the first host of SLURM_STEP_NODELIST / SLURM_JOB_NODELIST / SLURM_NODELIST
                  (what `scontrol show hostnames | head -1` prints), else 127.0.0.1; MASTER_PORT, else
                  15000 + SLURM_JOB_ID % 20000, so two jobs sharing a node rarely collide (set it yourself when
                  one job runs several multi-rank steps at once)
      restarts    SLURM_RESTART_COUNT (a requeued job)
    The step's variables come before the job's: `srun -n4` inside a larger allocation starts 4 ranks.
  * neither: one plain process (`LaunchEnv()`: source None, world 1, no master).

`launched` says whether this process is a rank of a group its launcher started: RANK set (torchrun), or
SLURM_PROCID with a task count (SLURM_STEP_NUM_TASKS or SLURM_NTASKS). Only then does `collectives.init` join a
group. A shell in an allocation (salloc: no SLURM_PROCID) or a batch script without --ntasks still reads the
allocation's shape, for the planner, but its world is not a group anyone else joins: it runs as one process
instead of waiting for ranks that never come.

Every value is checked: a variable set to "" counts as unset (scripts often export empty ones); a non-integer,
a negative number, a world or node size of 0, a rank not below the world, a port outside 1..65535 and an
unreadable node or tasks-per-node list raise UsageError("environment: ...") with the variable and its value.

Why these rules, where another reading would be possible:
  * LOCAL_RANK/GROUP_RANK missing: derived from RANK, because torchrun numbers ranks node by node; 0 would put
    every rank on the first device of the first node.
  * MASTER_ADDR/MASTER_PORT missing: the address and port `init` uses, never "unknown", so what the planner
    reports is what the ranks do.
  * tasks per node: this node's entry, because the nodes of a step like '2(x3),1' differ; an unreadable list is
    an error, not a guess.
  * the step's counts before the job's: `srun -n4` in a larger allocation starts 4 ranks, and the job's counts
    would have them wait for ranks that never come.
  * SLURM_PROCID alone (a task) or SLURM_JOB_ID with SLURM_NNODES (an allocation) is Slurm: a task needs its rank,
    the planner in an allocation its shape; `launched` keeps the latter from waiting for a group.
  * a bad value is an error, never a silent default: a wrong rank or world hangs the rendezvous instead.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from evenrl.errors import UsageError

TORCHRUN_PORT = 29500
LOCALHOST = "127.0.0.1"


@dataclass(frozen=True)
class LaunchEnv:
    """What a process learns from its environment. The defaults describe one plain process."""
    source: Literal["torchrun", "slurm"] | None = None
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    local_world: int = 1
    node_rank: int = 0
    nnodes: int = 1
    master_addr: str | None = None
    master_port: int | None = None
    restart_count: int = 0
    launched: bool = False  # a rank of a group its launcher started (see the module docstring)


def read_env(env: Mapping[str, str] | None = None) -> LaunchEnv:
    """The launch environment (default: os.environ) by the rules of the module docstring; LaunchEnv() outside
    torchrun and Slurm. Raises UsageError("environment: ...") on a bad value."""
    env = os.environ if env is None else env
    try:
        if _set(env, "WORLD_SIZE") and (_set(env, "RANK") or _set(env, "LOCAL_WORLD_SIZE")):
            return _torchrun(env)
        if _set(env, "SLURM_PROCID") or (_set(env, "SLURM_JOB_ID") and _set(env, "SLURM_NNODES")):
            return _slurm(env)
    except ValueError as e:
        raise UsageError(f"environment: {e}") from None
    return LaunchEnv()


def read_int(env: Mapping[str, str], key: str, default: int) -> int:
    """One non-negative integer variable by the same rules ("" = unset); UsageError("environment: ...")."""
    try:
        return _int(env, key, default)
    except ValueError as e:
        raise UsageError(f"environment: {e}") from None


def _torchrun(env: Mapping[str, str]) -> LaunchEnv:
    world = _size(env, "WORLD_SIZE")
    local_world = _size(env, "LOCAL_WORLD_SIZE", world)
    rank = _rank(env, "RANK", world, "WORLD_SIZE")
    return LaunchEnv("torchrun", rank, world, _int(env, "LOCAL_RANK", rank % local_world), local_world,
                     _int(env, "GROUP_RANK", rank // local_world), max(1, world // local_world),
                     env.get("MASTER_ADDR") or LOCALHOST, _port(env, TORCHRUN_PORT),
                     _int(env, "TORCHELASTIC_RESTART_COUNT", 0), launched=_set(env, "RANK"))


def _slurm(env: Mapping[str, str]) -> LaunchEnv:
    per_node_key = _first_set(env, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE")
    counts = tasks_per_node(env[per_node_key], per_node_key) if per_node_key else None
    nodes_key = _first_set(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES")
    nnodes = _size(env, nodes_key) if nodes_key else len(counts) if counts else 1
    tasks_key = _first_set(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
    world = _size(env, tasks_key) if tasks_key else sum(counts) if counts else nnodes
    node_rank = _int(env, "SLURM_NODEID", 0)
    local_world = counts[min(node_rank, len(counts) - 1)] if counts else max(1, world // nnodes)
    list_key = _first_set(env, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
    addr = env.get("MASTER_ADDR") or (_host(env, list_key) if list_key else LOCALHOST)
    world_from = tasks_key or (f"the sum of {per_node_key}" if counts else nodes_key) or "one task"
    return LaunchEnv("slurm", _rank(env, "SLURM_PROCID", world, world_from), world,
                     _int(env, "SLURM_LOCALID", 0), local_world, node_rank, nnodes, addr,
                     _port(env, 15000 + _int(env, "SLURM_JOB_ID", 0) % 20000), _int(env, "SLURM_RESTART_COUNT", 0),
                     launched=_set(env, "SLURM_PROCID") and tasks_key is not None)


def tasks_per_node(spec: str, key: str = "tasks per node") -> list[int]:
    """Slurm's compressed tasks-per-node list, one count per node: '2(x3),1' -> [2, 2, 2, 1]."""
    counts: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m or int(m.group(1)) < 1 or (m.group(2) and int(m.group(2)) < 1):
            raise ValueError(f"{key}={spec!r} is not a Slurm tasks-per-node list like '8' or '2(x3),1'")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def first_host(nodelist: str) -> str:
    """First host of a Slurm node list: 'gpu[03-05,9],cpu1' -> 'gpu03', 'rack[1-2]-n[07-08]' -> 'rack1-n07',
    '' -> ''. Raises ValueError on an unreadable list (an unclosed or empty bracket)."""
    text = nodelist.strip()
    m = re.match(r"(?:[^,\[\]]+|\[[^\[\]]*\])*", text)
    head = m.group(0) if m else ""
    if text[len(head):len(head) + 1] not in ("", ","):
        raise ValueError(f"cannot read Slurm node list {nodelist!r}")

    def first(group: re.Match) -> str:
        item = re.split(r"[-,]", group.group(1))[0].strip()
        if not item:
            raise ValueError(f"cannot read Slurm node list {nodelist!r}")
        return item
    return re.sub(r"\[([^\]]*)\]", first, head).strip()


def _set(env: Mapping[str, str], key: str) -> bool:
    return bool(env.get(key))


def _first_set(env: Mapping[str, str], *keys: str) -> str | None:
    return next((k for k in keys if _set(env, k)), None)


def _int(env: Mapping[str, str], key: str, default: int | None = None) -> int:
    raw = env.get(key)
    if not raw:
        if default is None:
            raise ValueError(f"{key} is not set")
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{key}={raw!r} is not an integer") from None
    if value < 0:
        raise ValueError(f"{key}={raw!r} is negative")
    return value


def _size(env: Mapping[str, str], key: str, default: int | None = None) -> int:
    value = _int(env, key, default)
    if value < 1:
        raise ValueError(f"{key}={env.get(key)!r} must be at least 1")
    return value


def _rank(env: Mapping[str, str], key: str, world: int, world_from: str) -> int:
    rank = _int(env, key, 0)
    if rank >= world:
        raise ValueError(f"{key}={env.get(key)!r} is not below the world size {world} ({world_from})")
    return rank


def _port(env: Mapping[str, str], default: int) -> int:
    port = _int(env, "MASTER_PORT", default)
    if not 1 <= port <= 65535:
        raise ValueError(f"MASTER_PORT={env.get('MASTER_PORT')!r} is not a port (1..65535)")
    return port


def _host(env: Mapping[str, str], key: str) -> str:
    try:
        host = first_host(env[key])
    except ValueError:
        raise ValueError(f"{key}={env[key]!r} is not a Slurm node list like 'gpu[03-05,9],cpu1'") from None
    return host or LOCALHOST
