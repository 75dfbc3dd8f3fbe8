"""`evenrl plan --from verl|easyr1|trl|openrlhf FILE [overrides] [layout flags]`: a peer's own config, the
checks that peer would fail on the layout (with the message it prints), and the equivalent evenrl config + plan.

    evenrl plan --from easyr1 examples/config.yaml data.rollout_batch_size=512 trainer.n_gpus_per_node=6
    evenrl plan --from verl ppo.yaml data.train_batch_size=2 trainer.n_gpus_per_node=4 --device-memory-gib 80
    evenrl plan --from trl grpo.yaml --nproc-per-node 4          # vllm_mode=server reserves one of the 4 GPUs
    evenrl plan --from openrlhf args.txt                          # the train_ppo_ray flags, as text or YAML/JSON

Files: verl/EasyR1 YAML (Hydra-style dotted overrides, a leading + or ++ is accepted); a TRL GRPOConfig as
YAML/JSON (plus `num_processes` and Open-R1's `model_name_or_path`/`dataset_name` when present); OpenRLHF's
command-line flags as YAML/JSON or as the command text itself. Keys not set take the peer's defaults.
Layout: verl/EasyR1 read trainer.nnodes x trainer.n_gpus_per_node, OpenRLHF actor_num_nodes x
actor_num_gpus_per_node (+ vllm_num_engines x vllm_tensor_parallel_size unless colocate_all_models); --nnodes /
--nproc-per-node replace those (OpenRLHF: the actor GPUs). TRL trains on num_processes or the layout flags,
minus one GPU for a vLLM server (use_vllm with vllm_mode=server).
Messages are the peers' own, word for word as their config checks and workers raise them (DeepSpeed's for
OpenRLHF's batch arithmetic).

One module per framework (verl, easyr1, trl, openrlhf), each a `translate(src, ns, t)` that fills a Translation;
what they share (reading files, typed reads, the common mappings) is in peers.reader. This package only joins
them: translate() below runs one and validates the result as an evenrl config. Printing is the command's
(evenrl.planner.cli.run_foreign), so nothing here imports the command that imports it.
"""

from __future__ import annotations

import argparse

from pydantic import ValidationError

from evenrl.config import RunConfig, flatten, validation_message, with_settings
from evenrl.errors import UsageError
from evenrl.planner.layout import Layout, has_shape_flags
from evenrl.planner.peers import easyr1, openrlhf, tables, trl, verl
from evenrl.planner.peers.reader import (
    NAMES, Check, Loaded, Source, Translation, parse_flags, read_foreign)

__all__ = ["NAMES", "TRANSLATORS", "Check", "Loaded", "Translation", "parse_flags", "read_foreign", "translate"]

TRANSLATORS = {"verl": verl.translate, "easyr1": easyr1.translate, "trl": trl.translate,
               "openrlhf": openrlhf.translate}
# where each peer states its layout, for the note when a file states none
LAYOUT_KEYS = {"verl": ("trainer.nnodes", "trainer.n_gpus_per_node"),
               "easyr1": ("trainer.nnodes", "trainer.n_gpus_per_node"),
               "openrlhf": ("actor_num_nodes", "actor_num_gpus_per_node"), "trl": ("num_processes",)}


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
    version, how = tables.detect_version(framework, set(flat) | set(spelled.values()) | set(unresolved),
                                         getattr(ns, "peer_version", None))
    t = Translation(framework, Layout(), version=version)
    t.notes += loaded.notes
    t.notes.append(f"rules of {tables.version_label(framework, version)} ({how}; --peer-version to choose)")
    hints = _layout_hints(framework, loaded, data, ns, t)
    src = Source(NAMES[framework], {**data, **hints} if isinstance(data, dict) else data)
    TRANSLATORS[framework](src, ns, t)
    tables.apply_maps(framework, version, src, t)
    t.checks = [c for c in t.checks if tables.check_applies(framework, version, c.version)]
    t.keys = tables.account(framework, version, {**flat, **unresolved}, spelled, t, src.reads, unresolved)
    try:
        cfg = with_settings(RunConfig(), t.settings)
    except ValidationError as e:
        loc = ".".join(str(x) for x in e.errors()[0]["loc"])
        raise UsageError(validation_message(e, f"{NAMES[framework]} {t.source.get(loc, loc)} -> evenrl")) from None
    return t, cfg


def _layout_hints(framework: str, loaded: Loaded, data: dict, ns: argparse.Namespace, t: Translation) -> dict:
    """The launcher's layout (srun/#SBATCH, accelerate, torchrun) where the peer's own keys do not state one."""
    launch, keys = loaded.launch, LAYOUT_KEYS[framework]
    stated = any(Source("", data).has(k) for k in keys)
    if has_shape_flags(ns):
        return {}
    hints: dict = {}
    if launch and framework in ("verl", "easyr1") and not stated:
        if launch.nnodes:
            hints["trainer.nnodes"] = launch.nnodes
        if launch.gpus_per_node:
            hints["trainer.n_gpus_per_node"] = launch.gpus_per_node
    elif launch and framework == "trl" and not stated:
        procs = launch.num_processes or (launch.nnodes or 1) * (launch.gpus_per_node or 0)
        if procs:
            hints["num_processes"] = procs
    if hints:
        t.notes.append("layout from the launcher's options: " + ", ".join(f"{k}={v}" for k, v in hints.items()))
    elif not stated and framework != "trl":
        t.notes.append(f"the file states no layout ({' / '.join(keys)}): planned on {NAMES[framework]}'s default "
                       "of 1 node x 8 GPUs (--nnodes / --nproc-per-node to change)")
    elif not stated:
        t.notes.append("the file states no layout (num_processes): planned on this machine's devices "
                       "(--nproc-per-node N to change)")
    return hints
