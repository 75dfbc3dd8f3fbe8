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

from evenrl.config import RunConfig, validation_message, with_settings
from evenrl.errors import UsageError
from evenrl.planner.layout import Layout
from evenrl.planner.peers import easyr1, openrlhf, trl, verl
from evenrl.planner.peers.reader import NAMES, Check, Source, Translation, parse_flags, read_foreign

__all__ = ["NAMES", "TRANSLATORS", "Check", "Translation", "parse_flags", "read_foreign", "translate"]

TRANSLATORS = {"verl": verl.translate, "easyr1": easyr1.translate, "trl": trl.translate,
               "openrlhf": openrlhf.translate}


def translate(framework: str, data: dict, ns: argparse.Namespace) -> tuple[Translation, RunConfig]:
    """The peer's config -> its failing checks and the equivalent evenrl RunConfig (validated)."""
    t = Translation(framework, Layout())
    TRANSLATORS[framework](Source(NAMES[framework], data), ns, t)
    try:
        cfg = with_settings(RunConfig(), t.settings)
    except ValidationError as e:
        loc = ".".join(str(x) for x in e.errors()[0]["loc"])
        raise UsageError(validation_message(e, f"{NAMES[framework]} {t.source.get(loc, loc)} -> evenrl")) from None
    return t, cfg
