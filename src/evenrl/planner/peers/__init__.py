"""`evenrl plan --from verl|easyr1|trl|openrlhf|slime FILE [overrides] [layout flags]`: a peer's own config, argument
file or launch script, the checks that peer (in the version the file is for) would fail on the layout (with the
message it prints), every key of the file accounted for, and the equivalent evenrl config + plan.

    evenrl plan --from verl run_qwen2-7b.sh                      # the launch script, read (never run)
    evenrl plan --from easyr1 examples/config.yaml data.rollout_batch_size=512 trainer.n_gpus_per_node=6
    evenrl plan --from trl grpo.yaml --nproc-per-node 4 --peer-version 0.18   # vllm_mode=server: a GPU for vLLM
    evenrl plan --from openrlhf train_ppo_ray.sh --write-config evenrl.yaml

Reading: peers.reader (YAML/JSON, argument files), peers.script and peers.shell (launch scripts), peers.launch
(a script's arguments on the base config it names). Knowledge: peers/data/<peer>.yaml and its key lists, read by
peers.tables alone (versions, check tags, spellings, key maps, reasons). Arithmetic: one module per framework
(verl, easyr1, trl, openrlhf, slime; the Megatron layout of verl's and slime's: peers.megatron), each a `translate(src, ns, t)` that fills a Translation with the peer's checks,
layout and batch settings. translate() below joins them: the version, the launcher's layout, the translator, the
tables' maps, the version's checks, every key's place, and the evenrl config validated. Printing is the
command's (evenrl.planner.cli.run_foreign), so nothing here imports the command that imports it.
Messages are the peers' own, word for word as their config checks and workers raise them (DeepSpeed's for
OpenRLHF's batch arithmetic).
"""

from __future__ import annotations

import argparse
import re

from pydantic import ValidationError

from evenrl.config import RunConfig, flatten, validation_message, with_settings
from evenrl.errors import UsageError
from evenrl.planner.layout import Layout, has_shape_flags
from evenrl.planner.peers import easyr1, openrlhf, slime, tables, trl, verl
from evenrl.planner.peers.reader import (
    NAMES, Check, Loaded, Source, Translation, parse_flags, read_foreign)

__all__ = ["NAMES", "TRANSLATORS", "Check", "Loaded", "Translation", "parse_flags", "read_foreign", "translate"]

TRANSLATORS = {"verl": verl.translate, "easyr1": easyr1.translate, "trl": trl.translate,
               "openrlhf": openrlhf.translate, "slime": slime.translate}
# where each peer states its layout, for the note when a file states none
LAYOUT_KEYS = {"verl": ("trainer.nnodes", "trainer.n_gpus_per_node"),
               "easyr1": ("trainer.nnodes", "trainer.n_gpus_per_node"),
               "openrlhf": ("actor_num_nodes", "actor_num_gpus_per_node"), "trl": ("num_processes",),
               "slime": ("actor_num_nodes", "actor_num_gpus_per_node")}


def translate(framework: str, loaded: Loaded | dict, ns: argparse.Namespace) -> tuple[Translation, RunConfig]:
    """The peer's settings -> its failing checks, every key accounted for (t.keys), and the equivalent evenrl
    RunConfig (validated)."""
    loaded = loaded if isinstance(loaded, Loaded) else Loaded(loaded)
    flat = flatten(loaded.data)
    unresolved = dict(loaded.unresolved)
    spelled = {k: k for k in flat}
    data = loaded.data
    if framework == "openrlhf":
        flat, spelled = tables.dealias(framework, flat)
        unresolved, more = tables.dealias(framework, unresolved)
        spelled.update(more)
        data = dict(flat)
    own = {k for k in {**flat, **unresolved} if k not in loaded.base_keys  # the file's own, not given with a +
           and not any(k == a or k.startswith(a + ".") for a in loaded.added)}
    version, how = tables.detect_version(framework, set(flat) | set(spelled.values()) | set(unresolved),
                                         getattr(ns, "peer_version", None), own)
    t = Translation(framework, Layout(), version=version, base=loaded.base)
    t.notes += loaded.notes
    t.notes.append(f"rules of {tables.version_label(framework, version)} ({how}; --peer-version to choose)")
    hints = _layout_hints(framework, loaded, data, ns, t)
    src = Source(NAMES[framework], {**data, **hints} if isinstance(data, dict) else data, loaded.launch)
    TRANSLATORS[framework](src, ns, t)
    tables.apply_maps(framework, version, src, t)
    tables.apply_precision(framework, src, t)
    tables.apply_constants(framework, version, t)
    t.checks = [c for c in t.checks if tables.check_applies(framework, version, c.version)]
    dotted = {flat: own for own, flat in tables.table(framework).get("aliases", {}).items()} \
        if version == tables.table(framework).get("dotted_version") else {}
    t.notes = _spell_as_the_file(t.notes, {**dotted, **spelled})
    t.keys = tables.account(framework, version, {**flat, **unresolved}, spelled, t, src.reads, unresolved,
                            loaded.added)
    for row in t.keys:
        row["from"] = "base" if row["key"] in loaded.base_keys else "file"
    try:
        cfg = with_settings(RunConfig(), t.settings)
    except ValidationError as e:
        loc = ".".join(str(x) for x in e.errors()[0]["loc"])
        raise UsageError(validation_message(e, f"{NAMES[framework]} {t.source.get(loc, loc)} -> evenrl")) from None
    return t, cfg


def _spell_as_the_file(notes: list[str], spelled: dict[str, str]) -> list[str]:
    """Notes name OpenRLHF's flags as the file spells them (--actor.adam.lr, not actor_learning_rate)."""
    renames = {flat: own for flat, own in spelled.items() if flat != own}
    if not renames:
        return notes
    names = re.compile(r"(?<![\w.])(" + "|".join(map(re.escape, sorted(renames, key=len, reverse=True))) + r")(?!\w)")
    return [names.sub(lambda m: renames[m.group(1)], n) for n in notes]


def _layout_hints(framework: str, loaded: Loaded, data: dict, ns: argparse.Namespace, t: Translation) -> dict:
    """The launcher's layout (srun/#SBATCH, accelerate, torchrun) where the peer's own keys do not state one."""
    launch, keys = loaded.launch, LAYOUT_KEYS[framework]
    stated = any(Source("", data).has(k) for k in keys)
    if has_shape_flags(ns):
        given = ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in (("nnodes", ns.nnodes), ("nproc_per_node",
                          ns.nproc_per_node), ("nodes", getattr(ns, "nodes", None))) if v is not None)
        for key in keys:  # the file's layout, replaced by the command line's: named as such, not as unmodelled
            t.unused[key] = f"overridden by the command line's layout ({given})"
        return {}
    hints: dict = {}
    if launch and framework in ("verl", "easyr1") and not stated:
        if launch.nnodes:
            hints["trainer.nnodes"] = launch.nnodes
        if launch.gpus_per_node:
            hints["trainer.n_gpus_per_node"] = launch.gpus_per_node
    elif launch and framework == "trl" and not stated:
        # accelerate's --num_processes counts every machine's processes; torchrun's --nproc_per_node one node's
        acc = launch.launcher
        procs = launch.num_processes or acc.get("num_processes")
        machines = launch.num_machines or acc.get("num_machines") if procs else launch.nnodes
        procs = procs or (machines or 1) * (launch.gpus_per_node or 0)
        if procs:
            hints["num_processes"] = procs
        if procs and (machines or 1) > 1:
            hints["num_machines"] = machines
    if hints:
        t.notes.append("layout from the launcher's options: " + ", ".join(f"{k}={v}" for k, v in hints.items()))
    elif not stated and framework != "trl":
        t.notes.append(f"the file states no layout ({' / '.join(keys)}): planned on {NAMES[framework]}'s default "
                       "of 1 node x 8 GPUs (--nnodes / --nproc-per-node to change)")
    elif not stated:
        t.notes.append("the file states no layout (num_processes): planned on this machine's devices "
                       "(--nproc-per-node N to change)")
    return hints
