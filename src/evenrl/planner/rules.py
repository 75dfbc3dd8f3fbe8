"""The planner's rules: each looks at a `Plan` and returns findings, each with the numbers and the fix.

    evenrl plan examples/plan_512x8.yaml data.prompts_per_step=2 rollout.samples_per_prompt=1 --nproc-per-node 4

Every rule in RULES runs on every plan, so all problems are reported at once. A rule is a plain torch-free
function `Plan -> list[Finding]`, here or in its topic's module, listed in RULES (and a row in tests/test_plan.py)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

from evenrl.config import RunConfig
from evenrl.data.readers import Fields, read_rows
from evenrl.errors import UsageError
from evenrl.models.files import LEAN_ARCHS, check_tokenizer_files, check_weights, no_config_fix, read_model_config
from evenrl.planner.groups import rule_group_memory, rule_mixed_speeds, rule_unknown_models
from evenrl.planner.lora import rule_lora
from evenrl.planner.memory import PHASES, RESIDENT
from evenrl.planner.moe import rule_moe
from evenrl.planner.model_parallel import rule_rollout_parallel, rule_sequence_parallel
from evenrl.planner.rewards import rule_reward_models, rule_rewards
from evenrl.planner.text import plural, seconds, size_text
from evenrl.planner.agents import rule_agent
from evenrl.planner.turns import rule_env, rule_trajectory_cap
from evenrl.planner.types import Finding, Plan
from evenrl.planner.vision import rule_vision

GROUP_ADVANTAGES = ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline")


def rule_layout(p: Plan) -> list[Finding]:
    lay = p.layout
    if lay.training_ranks >= 1:
        return []
    return [Finding("error", "no-training-ranks",
                    f"{plural(lay.rollout_devices, 'rollout device')} out of {lay.world}: no rank is left to train",
                    f"--rollout-devices {lay.world - 1}; or more devices (--nproc-per-node {lay.rollout_devices + 1})")]


def rule_capacity_weights(p: Plan) -> list[Finding]:
    t = p.layout.training_ranks
    w = p.layout.capacity_weights or p.config.parallel.fixed_capacity_weights()
    where = "--capacity-weights" if p.layout.capacity_weights else "parallel.capacity_weights"
    if not w or t < 1:
        return []
    if len(w) != t:
        ones = ",".join(["1"] * t) if t <= 16 else f"1,...,1 ({t} numbers)"
        example = f"--capacity-weights {ones}" if where.startswith("--") else f"{where}=[{ones}]"
        return [Finding("error", "capacity-weights",
                        f"{where} has {plural(len(w), 'weight')} for {plural(t, 'training rank')}",
                        f"give one weight per training rank, e.g. {example}; or drop it")]
    # The flags and the config refuse such weights; a Layout built in code can still carry them.
    if not all(x > 0 and math.isfinite(x) for x in w):
        return [Finding("error", "capacity-weights", f"{where}={list(w)} has a weight <= 0",
                        "every weight must be a positive relative speed, e.g. 1 or 2")]
    return []


def rule_data(p: Plan) -> list[Finding]:
    d = p.config.data
    if not d.path:
        return [Finding("warning", "data-path", "data.path is empty: no prompts to train on",
                        "data.path=FILE.jsonl (or .parquet, or a local Hugging Face dataset directory)")]
    out = []  # every problem at once: a bad data.path does not hide a bad eval.path
    if not Path(d.path).expanduser().exists():
        out.append(Finding("error", "data-path", f"data.path {d.path!r} does not exist (evenrl never downloads)",
                           "point data.path at a local .jsonl/.parquet file or dataset directory"))
    elif p.dataset_rows == 0:
        out.append(Finding("error", "data-path", f"data.path {d.path!r} has no rows", "use a non-empty dataset"))
    elif problem := dataset_problem(p.config, d.path, "data.path"):
        out.append(Finding("error", "data-file", *problem))
    elif p.dataset_rows is not None and p.dataset_rows < d.prompts_per_step:
        out.append(Finding("warning", "prompts-exceed-dataset",
                           f"{plural(d.prompts_per_step, 'prompt')} per step from a dataset of "
                           f"{plural(p.dataset_rows, 'row')}: every step repeats prompts",
                           f"data.prompts_per_step={p.dataset_rows}"))
    e = p.config.eval.path
    if e and not Path(e).expanduser().exists():
        out.append(Finding("error", "eval-path", f"eval.path {e!r} does not exist",
                           "point eval.path at a local .jsonl/.parquet file or dataset directory, or eval.path=''"))
    elif e and (problem := dataset_problem(p.config, e, "eval.path")):
        out.append(Finding("error", "eval-file", problem[0], problem[1] + "; or eval.path=''"))
    return out


# How much of a dataset the plan reads: the rows evenrl train would refuse are usually near the top (a wrong
# field name, a header line); the trainer reads the rest, before it writes anything.
PLAN_DATA_BYTES = 16 * 1024**2  # of each .jsonl file
PLAN_DATA_ROWS = 1000  # of each parquet / Arrow table, after its schema
PLAN_IMAGE_ROWS = 64  # rows whose images are decoded (a Geometry3K image takes milliseconds)
_DATA_FIX = ("fix the file (evenrl train reads it the same way); or point {key} at another .jsonl/.parquet file "
             "or dataset directory, or set data.prompt_field / data.answer_field to its columns")


def dataset_problem(cfg: RunConfig, path: str, key: str) -> tuple[str, str] | None:
    """(What evenrl train would refuse in the dataset at `path`, its fix) or None: its first rows, every column."""
    try:
        fields = Fields(cfg.data.prompt_field, cfg.data.answer_field, tuple(cfg.data.extra_fields),
                        cfg.data.image_key or None, cfg.data.max_images_per_prompt)
        read_rows(str(Path(path).expanduser()), fields, max_bytes=PLAN_DATA_BYTES, max_rows=PLAN_DATA_ROWS,
                  image_rows=PLAN_IMAGE_ROWS)
    except UsageError as e:  # an image's own fix (evenrl.data.images.ImageError), else the file's
        return str(e), getattr(e, "fix", None) or _DATA_FIX.format(key=key)
    return None


def rule_model(p: Plan) -> list[Finding]:
    m = p.config.model
    path = Path(m.path).expanduser() if m.path else None
    if path is not None and not path.is_dir():
        return [Finding("error", "model-path", f"model.path {m.path!r} is not a local directory",
                        "a local Hugging Face model directory, or a hub id (org/name, e.g. "
                        "Qwen/Qwen2.5-0.5B-Instruct)")]
    if path is not None and not (path / "config.json").is_file():
        return [Finding("error", "model-path", f"model.path {m.path!r} has no config.json; {no_config_fix(path)}",
                        "point model.path at a Hugging Face model directory (config.json, weights, tokenizer)")]
    out = []
    if path is not None:  # what load_policy checks before transformers sees the directory
        out += _decoder_findings(p.config, str(path))
        for rule, check, fix in (
                ("model-config", read_model_config, "point model.path at a decoder-only Hugging Face model"),
                ("model-tokenizer", check_tokenizer_files, "save the tokenizer into model.path "
                                                           "(tokenizer.save_pretrained(model.path))"),
                ("model-weights", check_weights, "re-download the model, or save it again with save_pretrained")):
            try:
                check(str(path))
            except UsageError as e:
                out.append(Finding("error", rule, str(e), fix))
    if p.dims and p.dims.max_positions and p.sample_tokens > p.dims.max_positions:
        field = "max_trajectory_tokens" if p.config.multi_turn() else "max_new_tokens"
        out.append(Finding("warning", "max-positions",
                           f"max_prompt_tokens + {field} = {p.sample_tokens:,} exceeds the model's "
                           f"max_position_embeddings {p.dims.max_positions:,}",
                           f"rollout.{field}={max(1, p.dims.max_positions - p.config.data.max_prompt_tokens)}"))
    return out


def _decoder_findings(c: RunConfig, path: str) -> list[Finding]:
    r = c.rollout
    if r.engine != "hf" or r.decoder not in ("lean", "static"):
        return []
    try:
        archs = read_model_config(path).get("architectures") or []
    except UsageError:
        return []  # model-config says what is wrong with it
    if any(a in LEAN_ARCHS for a in archs):
        return []
    return [Finding("error", "rollout-decoder", f"rollout.decoder={r.decoder} runs {', '.join(LEAN_ARCHS)}; "
                    f"{path}/config.json names {archs}", "rollout.decoder=auto")]


def rule_groups(p: Plan) -> list[Finding]:
    c = p.config
    k, adv = c.rollout.samples_per_prompt, c.algo.advantage
    if adv not in GROUP_ADVANTAGES:
        return []
    if k == 1:
        return [Finding("error", "single-sample-group",
                        f"advantage {adv} compares samples of one prompt, but samples_per_prompt=1: "
                        "every advantage is 0 and nothing is learned",
                        "rollout.samples_per_prompt>=2 (4-16 is usual)")]
    if c.rollout.temperature == 0:
        return [Finding("error", "greedy-group",
                        f"temperature 0 makes the {k} samples of a prompt identical: every advantage is 0",
                        "rollout.temperature=1.0")]
    if k < 4 and c.algo.std_scale == "group":
        return [Finding("note", "small-group",
                        f"the group std of {k} samples is coarse (with 0/1 rewards every advantage is "
                        f"{'+-0.71' if k == 2 else '+-0.58 or +-1.15'} or 0)",
                        "rollout.samples_per_prompt>=4; or algo.std_scale=batch")]
    return []


def rule_algorithms(p: Plan) -> list[Finding]:
    """Settings of dynamic sampling, the overlong penalty and the critic that cannot work as given."""
    c, out = p.config, []
    k = c.rollout.samples_per_prompt
    if c.algo.filter_groups and k == 1:
        out.append(Finding("error", "filter-single-sample",
                           "algo.filter_groups drops groups whose rewards are all equal, but samples_per_prompt=1: "
                           "every group has one reward", "rollout.samples_per_prompt>=2; or algo.filter_groups=false"))
    if c.algo.filter_groups and c.algo.advantage in ("reinforce_pp", "gae"):
        out.append(Finding("note", "filter-per-token",
                           f"algo.filter_groups with {c.algo.advantage}: groups are still filtered by their rewards, "
                           "though this advantage does not compare a prompt's samples", "algo.filter_groups=false"))
    if c.rewards.overlong_buffer > c.sampled_tokens():
        what = ("the most a trajectory's turns sample" if c.multi_turn() else "rollout.max_new_tokens")
        out.append(Finding("error", "overlong-buffer",
                           f"rewards.overlong_buffer={c.rewards.overlong_buffer} is longer than "
                           f"{what} ({c.sampled_tokens()})",
                           f"rewards.overlong_buffer<={c.sampled_tokens()} (DAPO: 4096 of 20480)"))
    if c.algo.advantage == "gae" and c.critic.path and not Path(c.critic.path).expanduser().is_dir():
        out.append(Finding("error", "critic-path", f"critic.path {c.critic.path!r} is not a local directory "
                           "nor a hub id", "critic.path='' (the policy's weights), a local directory or a hub id "
                                           "(org/name)"))
    if c.algo.advantage != "gae" and c.critic.path:
        out.append(Finding("warning", "critic-unused", f"critic.path is set but algo.advantage={c.algo.advantage} "
                           "trains no critic", "algo.advantage=gae; or critic.path=''"))
    return out


def rule_minibatches(p: Plan) -> list[Finding]:
    c, out = p.config, []
    want, got = c.algo.minibatches_per_step, len(p.minibatch_sizes)
    if p.ranks and got < want:
        n, prompts = c.samples_per_step(), c.data.prompts_per_step
        why = (f"{plural(n, 'sample')}" if want > n else
               f"{plural(prompts, 'prompt')} (mini-batch cuts fall between prompt groups)")
        out.append(Finding("error", "empty-minibatches",
                           f"minibatches_per_step={want} but {why} make only {got}: "
                           f"{plural(want - got, 'mini-batch')} would be empty",
                           f"algo.minibatches_per_step={got}; or data.prompts_per_step={max(prompts, want)}"))
    sizes = p.minibatch_sizes
    if len(sizes) > 1 and max(sizes) > 1.25 * min(sizes):
        m = len(sizes)
        even = math.ceil(c.data.prompts_per_step / m) * m
        out.append(Finding("note", "uneven-minibatches",
                           f"mini-batches of {min(sizes)}..{max(sizes)} samples: cuts fall between prompt groups",
                           f"data.prompts_per_step={even} (a multiple of minibatches_per_step={m})"))
    return out


def _prompts_for(p: Plan, rows_per_rank: int) -> int:
    """Smallest prompts_per_step whose smallest mini-batch gives every training rank (SP group) rows_per_rank rows."""
    c, t = p.config, p.dp_size
    m, k = c.algo.minibatches_per_step, c.rollout.samples_per_prompt
    return m * math.ceil(t * rows_per_rank / k)


def rule_idle(p: Plan) -> list[Finding]:
    c, t = p.config, p.dp_size
    idle = p.idle
    if not idle:
        return []
    mrows = c.train.min_rows_per_micro_batch
    per_mb = min(p.minibatch_sizes)
    nmb = len(p.minibatch_sizes)
    k, prompts = c.rollout.samples_per_prompt, c.data.prompts_per_step
    head = f"{plural(prompts, 'prompt')} × {plural(k, 'sample')}"
    if nmb > 1:
        head += f" in {nmb} mini-batches (smallest {per_mb})"
    why = f" with min_rows_per_micro_batch={mrows}" if mrows > 1 else ""
    fixes = [f"data.prompts_per_step={_prompts_for(p, mrows)}"]
    need_k = math.ceil(t * mrows * nmb / prompts)
    if need_k > k:
        fixes.append(f"rollout.samples_per_prompt>={need_k}")
    if nmb > 1 and c.samples_per_step() // (t * mrows) >= 1:
        fixes.append(f"algo.minibatches_per_step={max(1, c.samples_per_step() // (t * mrows))}")
    fixes.append(f"or fewer training ranks ({max(1, per_mb // mrows)})")
    if mrows > 1:
        fixes.append("or SyncBatchNorm (CUDA, gathers statistics over ranks) with train.min_rows_per_micro_batch=1")
    idle_all = sum(1 for r in p.ranks if r.idle_minibatches == nmb)
    return [Finding("warning", "idle-ranks",
                    f"{head} on {plural(t, p.unit)}{why} leaves {plural(len(idle), p.unit.split()[-1])} idle"
                    + (f" ({idle_all} for the whole step)" if nmb > 1 and idle_all else ""),
                    ", or ".join(fixes[:-2 if mrows > 1 else -1]) + "; " + "; ".join(fixes[-2 if mrows > 1 else -1:]))]


def rule_min_rows(p: Plan) -> list[Finding]:
    c = p.config
    m, length, cap = c.train.min_rows_per_micro_batch, p.sample_tokens, c.train.token_cap_per_micro_batch
    out = []
    if p.schedule_error:
        k, mbs, prompts = c.rollout.samples_per_prompt, c.algo.minibatches_per_step, c.data.prompts_per_step
        out.append(Finding("error", "min-rows", p.schedule_error,
                           f"data.prompts_per_step={mbs * math.ceil(m / k)} ({_prompts_for(p, m)} keeps every rank "
                           f"busy); or algo.minibatches_per_step={max(1, prompts // math.ceil(m / k))}"))
    if m > 1 and m * length > cap:
        out.append(Finding("warning", "min-rows-token-cap",
                           f"min_rows_per_micro_batch={m} rows of up to {length:,} tokens need {m * length:,} "
                           f"tokens, above token_cap_per_micro_batch={cap:,}: such micro-batches exceed the cap",
                           f"train.token_cap_per_micro_batch={m * length}"))
    return out


def rule_token_cap(p: Plan) -> list[Finding]:
    c, length, v = p.config, p.sample_tokens, p.vision_tokens
    cap, sp = c.train.token_cap_per_micro_batch, p.sequence_parallel  # an SP group's micro-batch: sp x the cap
    if length + v <= cap * sp:
        return []
    return [Finding("warning", "token-cap-oversize",
                    f"token_cap_per_micro_batch={cap:,}{f' x {sp} ranks' if sp > 1 else ''} is below max_prompt_"
                    f"tokens + max_new_tokens = {length:,}" + (f" + {v:,} vision-encoder tokens" if v else "")
                    + ": such samples run alone as oversize micro-batches (memory follows them, not the cap)",
                    f"train.token_cap_per_micro_batch={-(-(length + v) // sp)}; or rollout.max_new_tokens="
                    f"{max(1, cap * sp - v - c.data.max_prompt_tokens)}")]


def rule_imbalance(p: Plan) -> list[Finding]:
    if p.imbalance is None or p.idle or p.token_caps:  # per-device caps: uneven on purpose (rule_group_memory)
        return []
    c, t = p.config, p.dp_size
    k, m = c.rollout.samples_per_prompt, len(p.minibatch_sizes) or 1
    if p.bound_ratio and p.bound_ratio > 1.05:
        return [Finding("note", "imbalance", f"the busiest rank is {100 * (p.bound_ratio - 1):.0f}% above the "
                        "partition's lower bound (capacity weights that do not match the sample counts)",
                        "parallel.capacity_weights closer to 1, or more samples per step")]
    if p.imbalance < 1.10:
        return []
    step = t * m // math.gcd(t * m, k)  # prompts_per_step a multiple of this splits evenly
    even = math.ceil(c.data.prompts_per_step / step) * step
    return [Finding("note", "imbalance",
                    f"the busiest rank does {100 * (p.imbalance - 1):.0f}% more than an even split: "
                    f"{c.samples_per_step():,} whole samples over {plural(t, p.unit.removeprefix('training '))}"
                    + (f" in {m} mini-batches" if m > 1 else "") + " cannot split evenly (others wait)",
                    f"data.prompts_per_step={even} splits evenly")]


def rule_memory(p: Plan) -> list[Finding]:
    c, lay, mem = p.config, p.layout, p.memory
    if len(p.groups) > 1:
        return []  # each device group has its own: evenrl.planner.groups.rule_group_memory
    if mem is None:
        if p.dims_error:
            return [Finding("note", "memory-skipped", f"no memory estimate: {p.dims_error}", "")]
        if not c.model.path:
            return [Finding("note", "memory-skipped", "no memory estimate: model.path is empty",
                            "model.path=/local/model/dir (its config.json gives the dimensions)")]
        return []
    if mem.fits is None:
        return [Finding("note", "memory-unknown", f"estimated peak {mem.total_gib:.1f} GiB per rank; "
                        "device memory unknown", "--device-memory-gib 80 (your device's memory)")]
    # the parts of the phase that sets the peak: what a fix has to shrink
    phase = max(mem.phases, key=mem.phases.get) if mem.phases else ""
    keys = set(RESIDENT) | set(PHASES.get(phase, mem.breakdown))
    top = sorted(((v, k) for k, v in mem.breakdown.items() if v >= 0.05 and k in keys), reverse=True)[:4]
    parts = ", ".join(f"{k} {v:.1f}" for v, k in top)
    if not mem.fits:
        fixes = "; ".join(f.text() + (" (fits)" if f.fits else "") for f in p.memory_fixes)
        return [Finding("error", "memory-over",
                        f"estimated peak {mem.total_gib:.1f} GiB per rank > {lay.device_memory_gib:.1f} GiB "
                        f"device memory in {phase or 'the step'} ({parts} GiB)",
                        f"each alone, best first: {fixes}" if fixes else "use devices with more memory")]
    if mem.total_gib > 0.9 * lay.device_memory_gib:
        return [Finding("warning", "memory-tight", f"estimated peak {mem.total_gib:.1f} GiB of "
                        f"{lay.device_memory_gib:.1f} GiB per rank (> 90%; fragmentation may push it over)",
                        "model.gradient_checkpointing=true; or a lower train.token_cap_per_micro_batch")]
    return []


def rule_parallel(p: Plan) -> list[Finding]:
    c, lay, out = p.config, p.layout, []
    if c.parallel.cpu_offload == "full" and c.parallel.sharding != "fsdp":
        out.append(Finding("error", "offload-replicated", "cpu_offload=full needs sharding=fsdp: FSDP2's offload "
                           "policy moves the sharded parameters, gradients and optimizer state to the host, and a "
                           "replicated model has no shards", "parallel.cpu_offload=none" if lay.device == "cpu" else
                           "parallel.sharding=fsdp; or parallel.cpu_offload=none"))
    if c.parallel.cpu_offload == "full" and lay.device == "cpu":
        out.append(Finding("error", "offload-cpu", "cpu_offload=full needs an accelerator: FSDP2 copies each "
                           "offloaded shard to the device to gather it, so on a CPU-only layout the run fails at "
                           "its first forward", "parallel.cpu_offload=none; or plan GPUs (--device cuda)"))
    if c.parallel.sharding == "fsdp" and lay.training_ranks == 1 and c.parallel.cpu_offload == "none":
        out.append(Finding("note", "fsdp-one-rank", "sharding=fsdp over 1 training rank shards nothing "
                           "(it still gathers each block before use)", "parallel.sharding=replicated, or more ranks"))
    if lay.rollout_devices and lay.training_ranks >= 1 and not c.rollout.max_staleness:
        r, t = lay.rollout_devices, lay.training_ranks
        out.append(Finding("note", "rollout-reserved",
                           f"reserved placement is synchronous: {plural(t, 'training rank')} wait{'s' if t == 1 else ''} while "
                           f"{plural(r, 'rollout device')} generate{'s' if r == 1 else ''} the whole step, and "
                           f"{'it waits' if r == 1 else 'they wait'} while they train; a step takes ~ G/{r} + U/{t} "
                           f"against ~ G/{lay.world} + U/{lay.world} colocated (G, U: one device's generation and "
                           f"update time). Reserved pays where G is small next to U or an engine needs its own "
                           f"devices", f"--rollout-devices 0 (then {plural(lay.world, 'rank')} train and generate); "
                           "or rollout.max_staleness=1 (the next step generates while this one trains)"))
    if c.rollout.memory_fraction > 0 and c.rollout.engine == "hf":
        out.append(Finding("warning", "rollout-reserve-unused",
                           f"rollout.memory_fraction={c.rollout.memory_fraction} reserves memory for a separate "
                           "engine; engine 'hf' samples with the training model", "rollout.memory_fraction=0"))
    total = p.optimizer_steps_per_step * c.train.steps
    if c.train.warmup_steps and c.train.warmup_steps >= total:
        out.append(Finding("warning", "warmup-longer-than-run",
                           f"warmup_steps={c.train.warmup_steps} >= {plural(total, 'optimizer step')} in the whole "
                           "run: the learning rate never reaches train.lr", f"train.warmup_steps={total // 10}"))
    return out


def rule_overlap(p: Plan) -> list[Finding]:
    """Overlapping generation with training (rollout.max_staleness) needs reserved rollout devices, and pays only
    where both sides take a similar time; the numbers are evenrl.planner.timing's estimates."""
    c, lay, ov, out = p.config, p.layout, p.overlap, []
    k = c.rollout.max_staleness
    if lay.rollout_devices and c.algo.filter_groups:
        # a round's need for more prompts is decided from the trainers' rewards; rollout ranks do not see them
        out.append(Finding("error", "reserved-filter-groups",
                           f"{plural(lay.rollout_devices, 'reserved rollout device')} run one generation round per "
                           "step; algo.filter_groups=true needs more rounds (the trainers decide them from rewards "
                           "the rollout devices never see)",
                           "--rollout-devices 0 (parallel.rollout_devices=0); or algo.filter_groups=false"))
    if k and not lay.rollout_devices:
        if lay.world < 2:
            fix = "--nproc-per-node 2 --rollout-devices 1 (parallel.rollout_devices=1)"
        else:
            r = ov.best.rollout_devices if ov else 1
            why = f" (the estimated best split of {lay.world})" if ov else ""
            fix = f"--rollout-devices {r} (parallel.rollout_devices={r}){why}"
        out.append(Finding("error", "staleness-needs-reserved",
                           f"rollout.max_staleness={k} overlaps generation with training, which needs devices "
                           "that only generate; none is reserved, so every rank would train and generate in turn",
                           f"{fix}; or rollout.max_staleness=0"))
    if not (k and lay.rollout_devices and lay.training_ranks >= 1):
        return out
    at = ov.at if ov else None
    if at and at.saved_s < 0.10 * at.sync_s:
        best = ov.best
        gen, train = at.generation_s, at.training_s
        side = (f"generation dominates (the {plural(at.training_ranks, 'training rank')} wait)" if gen >= train else
                f"training dominates (the {plural(at.rollout_devices, 'rollout device')} wait)")
        fixes = []
        if best.rollout_devices != at.rollout_devices and best.overlapped_s < 0.95 * at.overlapped_s:
            fixes.append(f"--rollout-devices {best.rollout_devices} (parallel.rollout_devices="
                         f"{best.rollout_devices}: est. {seconds(best.overlapped_s)} per step)")
        fixes.append("rollout.max_staleness=0 (on-policy samples for about the same step time)")
        out.append(Finding("warning", "overlap-no-gain",
                           f"overlap saves an estimated {seconds(at.saved_s)} of a {seconds(at.sync_s)} step "
                           f"({100 * at.saved_s / at.sync_s:.0f}% < 10%): generation {seconds(gen)} on "
                           f"{plural(at.rollout_devices, 'rollout device')} vs training {seconds(train)} on "
                           f"{plural(at.training_ranks, 'rank')}; {side}", "; ".join(fixes)))
    corr, cap = c.algo.importance_correction, c.algo.importance_cap
    how = (f"corrected by algo.importance_correction={corr} (weights capped at {cap:g})" if corr != "none" else
           "not corrected (algo.importance_correction=none)")
    size = f" (+{size_text(k * ov.weights_gib)} per checkpoint)" if ov else ""
    out.append(Finding("note", "off-policy-overlap",
                       f"rollout.max_staleness={k}: samples are up to {plural(k, 'step')} off-policy, {how}; "
                       f"checkpoints hold {plural(k, 'earlier weight version')} in {c.model.dtype}{size}, so a "
                       "resumed run regenerates the steps in flight exactly",
                       "algo.importance_correction=stale" if corr == "none" else ""))
    return out


def rule_trackers(p: Plan) -> list[Finding]:
    """Trackers whose client is not installed: the run would stop at its start (evenrl.train.trackers)."""
    log, out = p.config.log, []
    need = {"wandb": ["wandb"], "mlflow": ["mlflow"] + ([] if log.mlflow.tracking_uri else ["sqlalchemy", "alembic"])}
    for name in log.trackers:
        missing = [m for m in need.get(name, []) if importlib.util.find_spec(m) is None]
        if missing:
            why = " (the local SQLite store of an empty log.mlflow.tracking_uri)" if "mlflow" not in missing else ""
            out.append(Finding("error", "tracker-missing", f"log.trackers names {name}, but {', '.join(missing)} "
                               f"{'is' if len(missing) == 1 else 'are'} not installed here{why}",
                               f"pip install -e '.[trackers]'; or leave {name} out of log.trackers"))
    return out


RULES = [rule_layout, rule_capacity_weights, rule_data, rule_model, rule_rewards, rule_reward_models, rule_groups,
         rule_algorithms, rule_minibatches, rule_min_rows, rule_idle, rule_token_cap, rule_imbalance, rule_memory,
         rule_group_memory, rule_mixed_speeds, rule_parallel, rule_overlap, rule_vision, rule_lora, rule_trackers,
         rule_env, rule_trajectory_cap, rule_unknown_models, rule_agent, rule_sequence_parallel, rule_rollout_parallel,
         rule_moe]
