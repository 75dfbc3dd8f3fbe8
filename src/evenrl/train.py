"""GRPO-family RL post-training of a Hugging Face causal LM. The whole step reads top to bottom in `rl_step`.

    evenrl train examples/demo.yaml                          # one process
    evenrl train examples/demo.yaml --nproc-per-node 3       # three local processes (torch.distributed.run)
    evenrl train examples/demo.yaml --resume                 # continue from the run directory's latest checkpoint

One step: sample prompts -> rollout -> rewards -> advantages -> exchange to the planned ranks
-> old/reference log-probs when needed -> mini-batch updates -> metrics -> checkpoint.

Why the result does not depend on the number of ranks:
  * the prompt order comes from (seed, epoch) only; each sample's randomness from (seed, step, prompt id, sample);
  * advantages are computed from the whole step's rewards on every rank;
  * mini-batch membership is fixed before ranks are considered (evenrl.schedule);
  * losses are divided by the mini-batch's global counts and gradients are summed (evenrl.update).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from evenrl import checkpoint, dist
from evenrl.algos import compute_advantages, entropy_from_logits, kl_penalty, policy_loss, token_logprobs
from evenrl.batch import Batch
from evenrl.config import RunConfig, config_to_yaml
from evenrl.errors import UsageError
from evenrl.evaluate import evaluate
from evenrl.models import encode_prompt, load_policy
from evenrl.prompts import PromptSampler, filter_by_length, load_prompts
from evenrl.rewards import resolve, score_all
from evenrl.rollout import SamplingParams, generate
from evenrl.runlog import RunLog
from evenrl.schedule import make_schedule
from evenrl.update import (compute_logprobs, entropy_stats, minibatch_denominators, minibatch_update,
                           ragged_to_right_aligned)

STAT_NAMES = ["policy/loss", "policy/clip_fraction", "policy/approx_kl", "kl", "entropy"]


# ------------------------------------------------------------------------------------------ the step

def rl_step(step: int, run: "Run") -> tuple[dict, list[dict]]:
    """One RL step on this rank; returns the step's global metrics and a few of this rank's completions."""
    cfg, timer = run.cfg, Timer()
    prompt_ids = run.sampler.next_prompts(cfg.data.prompts_per_step)           # same on every rank

    with timer("rollout"):
        local = rollout(run, step, prompt_ids)                                  # this rank's prompts x samples
    with timer("reward"):
        local, reward_stats = add_rewards(run, local)
    if cfg.algo.kl_coef > 0 and cfg.algo.kl_in == "reward":
        with timer("logprobs"):
            add_reward_kl(run, local)
    with timer("advantage"):
        everyone, failures = gather_rows(local, reward_stats.get("failures", 0))  # per-sample numbers of all ranks
        add_advantages(run, local, everyone)
    with timer("exchange"):
        schedule = plan_step(run, everyone)
        batch, micro = exchange(run, local, schedule)                           # rows this rank trains on
        denoms = [minibatch_denominators(everyone["response_len"], mb.rows) for mb in schedule.minibatches]
    with timer("logprobs"):
        if cfg.algo.kl_coef > 0 and cfg.algo.kl_in == "loss":
            add_logprobs(run, batch, "ref_logp", run.reference, flat(micro))
        if needs_old_logprobs(cfg):
            add_logprobs(run, batch, "old_logp", run.model, flat(micro))
    with timer("update"):
        stats = update(run, batch, micro, denoms)

    metrics = step_metrics(run, everyone, schedule, stats, failures, timer)
    return metrics, example_rows(local)


# ------------------------------------------------------------------------------------------ named pieces

def rollout(run: "Run", step: int, prompt_ids: list[int]) -> Batch:
    """Generate this rank's share of the step's samples (rollout_shares): whole prompts where the ranks divide
    them, a prompt's samples split over ranks where they do not (2 prompts x 8 samples on 4 ranks: 4 samples each)."""
    cfg = run.cfg
    n = cfg.rollout.samples_per_prompt
    costs = [len(run.prompt_tokens[i]) + cfg.rollout.max_new_tokens for i in prompt_ids]
    mine = rollout_shares(costs, n, dist.world(), cfg.parallel.capacity_weights)[dist.rank()]
    params = SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature,
                            top_p=cfg.rollout.top_p, samples_per_prompt=n, seed=cfg.train.seed)
    run.model.eval()
    completions = generate(run.model, [run.prompt_tokens[prompt_ids[p]] for p, _, _ in mine],
                           [p for p, _, _ in mine], params, step=step,  # key = position in the step: rank-free
                           eos_token_ids=run.eos_ids, pad_token_id=run.pad_id,
                           sample_ranges=[(first, count) for _, first, count in mine]) if mine else []
    run.model.train()
    tokens, resp_len, index, group, row_ids, texts, finished = [], [], [], [], [], [], []
    for (p, _, _), samples in zip(mine, completions):
        prompt = run.prompt_tokens[prompt_ids[p]]
        for c in samples:
            tokens.append(torch.tensor(prompt + c.token_ids, dtype=torch.long))
            resp_len.append(len(c.token_ids))
            index.append(p * n + c.sample_index)
            group.append(p)
            row_ids.append(prompt_ids[p])
            texts.append(run.tokenizer.decode(c.token_ids, skip_special_tokens=True))
            finished.append(c.finished)
    return Batch({
        "sample_index": torch.tensor(index, dtype=torch.long),
        "tokens": _ragged(tokens, torch.long),
        "response_len": torch.tensor(resp_len, dtype=torch.long),
        "group": torch.tensor(group, dtype=torch.long),
        "finished": torch.tensor(finished, dtype=torch.bool),
        "row_id": row_ids,
        "completion": texts,
    })


def rollout_shares(prompt_costs: list[float], n: int, world: int, weights=None) -> list[list[tuple[int, int, int]]]:
    """Per rank, the (prompt, first sample, count) it generates. The step's samples, prompt by prompt, are cut into
    `world` runs of near-equal cost (in proportion to the capacity weights), so each rank's work is within one
    sample of its share and a prompt's samples are split over as few ranks as possible (each part repeats the
    prompt's prefill). Every rank computes the same cut; a sample's randomness is keyed, so where it runs does
    not change it."""
    w = list(weights) if weights else [1.0] * world
    total = sum(prompt_costs) * n
    ends = [total * sum(w[: r + 1]) / sum(w) for r in range(world)]
    shares: list[list[list[int]]] = [[] for _ in range(world)]
    done, r = 0.0, 0
    for p, cost in enumerate(prompt_costs):
        for sample in range(n):
            while r < world - 1 and done + cost / 2 > ends[r]:  # a sample goes where its midpoint falls
                r += 1
            if shares[r] and shares[r][-1][0] == p:
                shares[r][-1][2] += 1
            else:
                shares[r].append([p, sample, 1])
            done += cost
    return [[tuple(x) for x in share] for share in shares]


def add_rewards(run: "Run", batch: Batch) -> tuple[Batch, dict]:
    rows = [run.rows[r] for r in batch["row_id"]]
    scores, stats = score_all(run.reward_fns, batch["completion"], rows, run.cfg.rewards.timeout_s,
                              isolate=run.cfg.rewards.isolate)
    batch["reward"] = torch.tensor(scores, dtype=torch.float32)
    return batch, stats


def add_logprobs(run: "Run", batch: Batch, name: str, model, micro_rows: list[list[int]]) -> None:
    logps = compute_logprobs(model, batch, micro_rows, temperature=run.temperature, pad_token_id=run.pad_id)
    batch[name] = _ragged(logps, torch.float32)


def add_reward_kl(run: "Run", batch: Batch) -> None:
    """KL as a reward penalty: each sequence's summed per-token KL(policy || reference) at sampling time."""
    micro = singles(len(batch))
    logp = compute_logprobs(run.model, batch, micro, temperature=run.temperature, pad_token_id=run.pad_id)
    ref = compute_logprobs(run.reference, batch, micro, temperature=run.temperature, pad_token_id=run.pad_id)
    kl = [kl_penalty(a, b, run.cfg.algo.kl_estimator).sum() for a, b in zip(logp, ref)]
    batch["kl_sum"] = torch.stack(kl).float() if kl else torch.zeros(0)


def gather_rows(local: Batch, failures: int = 0) -> tuple[dict[str, torch.Tensor], int]:
    """Every rank's per-sample scalars, ordered by global sample index, and the step's reward failures summed
    over ranks (they ride along: no all-reduce of their own). dist.all_gather_tensors: no pickling."""
    cols = ["sample_index", "group", "reward", "response_len", "finished"]
    mine = {c: local[c] for c in cols}
    mine["total_len"] = local["tokens"].lengths
    if "kl_sum" in local:
        mine["kl_sum"] = local["kl_sum"]
    parts = dist.all_gather_tensors({**{k: v.cpu() for k, v in mine.items()},
                                     "failures": torch.tensor([int(failures)], dtype=torch.long)})
    total_failures = sum(int(p.pop("failures")) for p in parts)
    merged = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
    order = torch.argsort(merged["sample_index"])
    return {k: v[order] for k, v in merged.items()}, total_failures


def add_advantages(run: "Run", local: Batch, everyone: dict) -> None:
    algo = run.cfg.algo
    rewards = everyone["reward"].double()
    if "kl_sum" in everyone:
        rewards = rewards - algo.kl_coef * everyone["kl_sum"].double()
    kw = {"std_scale": algo.std_scale} if algo.advantage == "grpo" else {}
    adv = compute_advantages(algo.advantage, rewards, everyone["group"], **kw).float()
    everyone["advantage"] = adv
    local["advantage"] = adv[local["sample_index"]]  # sample_index is the position in `everyone`


def plan_step(run: "Run", everyone: dict):
    """The step schedule from all-gathered lengths: every rank computes the same one, no coordinator."""
    cfg = run.cfg
    return make_schedule(everyone["total_len"].tolist(), world=dist.world(),
                         minibatches=cfg.algo.minibatches_per_step, token_cap=cfg.train.token_cap_per_micro_batch,
                         groups=everyone["group"].tolist(), weights=cfg.parallel.capacity_weights,
                         min_rows=cfg.train.min_rows_per_micro_batch, inert=zero_gradient_rows(cfg, everyone))


def zero_gradient_rows(cfg: RunConfig, everyone: dict) -> list[bool] | None:
    """Samples whose loss gradient is exactly zero, so nobody needs to run them: with no per-token KL or entropy
    term the policy loss is advantage x f(ratio), and the advantage is 0 (a GRPO group with equal rewards; with
    0/1 rewards that is every all-right and all-wrong group). None when nothing may be skipped."""
    algo, train = cfg.algo, cfg.train
    kl_in_loss = algo.kl_coef > 0 and algo.kl_in == "loss"
    if (not train.skip_zero_gradient_samples or kl_in_loss or algo.entropy_coef > 0
            or train.min_rows_per_micro_batch > 1):
        return None
    return (everyone["advantage"] == 0).tolist()


def exchange(run: "Run", local: Batch, schedule) -> tuple[Batch, list[list[list[int]]]]:
    """Move each sample to the rank the schedule trains it on. Returns the rank's rows and, per mini-batch,
    its micro-batches as positions into those rows."""
    owner = {}
    for mb in schedule.minibatches:
        for r, micros in enumerate(mb.per_rank):
            for m in micros:
                for row in m.rows:
                    owner[row] = r
    # rows nobody runs (zero gradient) are left out: they only count in the denominators, taken from `everyone`
    run_here = [i for i, s in enumerate(local["sample_index"].tolist()) if s in owner]
    if len(run_here) < len(local):
        local = local.select(run_here)
    batch = dist.exchange(local, [owner[int(i)] for i in local["sample_index"]])
    pos = {int(s): i for i, s in enumerate(batch["sample_index"])}
    micro = [[[pos[row] for row in m.rows] for m in mb.per_rank[dist.rank()]] for mb in schedule.minibatches]
    return batch, micro


def needs_old_logprobs(cfg: RunConfig) -> bool:
    # With one optimizer step per rollout the policy that sampled is the one being updated: ratio == 1
    # exactly, so old log-probs are the current ones detached and a whole forward pass is saved.
    return cfg.algo.minibatches_per_step > 1 or cfg.algo.epochs_per_step > 1


def update(run: "Run", batch: Batch, micro: list[list[list[int]]], denoms: list) -> dict:
    cfg, algo = run.cfg, run.cfg.algo

    def loss_fn(logits, targets, mask, mb):
        logp = token_logprobs(logits, targets, run.temperature)
        old = ragged_to_right_aligned(mb, "old_logp", logp.device) if "old_logp" in mb else logp.detach()
        adv = mb["advantage"].to(logp.device)
        per_token, pstats = policy_loss(logp, old, adv, clip_low=algo.clip_low, clip_high=algo.clip_high, mask=mask)
        n = mask.sum()
        stats = {"policy/loss": ((per_token * mask).sum().detach(), n),
                 "policy/clip_fraction": (pstats["clipped_tokens"], n),
                 "policy/approx_kl": (pstats["approx_kl_sum"], n)}
        if "ref_logp" in mb:
            kl = kl_penalty(logp, ragged_to_right_aligned(mb, "ref_logp", logp.device), algo.kl_estimator)
            if algo.kl_in == "loss":
                per_token = per_token + algo.kl_coef * kl
            stats["kl"] = ((kl.detach() * mask).sum(), n)
        if algo.entropy_coef > 0:
            ent = entropy_from_logits(logits, run.temperature)
            per_token = per_token - algo.entropy_coef * ent
            stats["entropy"] = ((ent.detach() * mask).sum(), n)
        else:
            stats["entropy"] = entropy_stats(logits, mask, run.temperature)
        return per_token, stats

    totals: dict[str, float] = {}
    updates = 0
    for _ in range(algo.epochs_per_step):
        for rows, denom in zip(micro, denoms):
            stats = minibatch_update(run.model, run.optimizer, run.lr_scheduler, batch, rows, denom, loss_fn=loss_fn,
                                     stat_names=STAT_NAMES, aggregation=algo.loss_aggregation,
                                     max_grad_norm=cfg.train.max_grad_norm, pad_token_id=run.pad_id)
            for k, v in stats.items():
                totals[k] = totals.get(k, 0.0) + v
            updates += 1
    return {k: v / updates for k, v in totals.items()}  # mean over the step's optimizer steps


def step_metrics(run: "Run", everyone: dict, schedule, stats: dict, failures: int, timer: "Timer") -> dict:
    rewards, lens = everyone["reward"].double(), everyone["response_len"].double()
    elapsed = max(sum(timer.seconds.values()), 1e-9)
    out = {
        "reward/mean": float(rewards.mean()) if len(rewards) else float("nan"),
        "reward/std": float(rewards.std()) if len(rewards) > 1 else 0.0,
        "advantage/abs_mean": float(everyone["advantage"].abs().mean()) if len(rewards) else 0.0,
        "response/length_mean": float(lens.mean()) if len(lens) else 0.0,
        "response/finished_fraction": float(everyone["finished"].float().mean()) if len(lens) else 0.0,
        "samples": len(rewards),
        "perf/tokens_per_s": float(everyone["total_len"].sum()) / elapsed,
        "perf/samples_per_s": len(rewards) / elapsed,
        "lr": run.optimizer.param_groups[0]["lr"],
        "load/rank_tokens": [int(x) for x in schedule.rank_loads()],
        "load/micro_steps": sum(schedule.micro_steps()),
        # samples no rank ran because their gradient is exactly zero (train.skip_zero_gradient_samples)
        "load/skipped_samples": sum(len(mb.rows) for mb in schedule.minibatches) - sum(
            len(m.rows) for mb in schedule.minibatches for micros in mb.per_rank for m in micros),
    }
    out.update(stats)
    out.update({f"time/{k}": v for k, v in timer.seconds.items()})
    out["reward/failures"] = int(failures)  # summed over ranks by gather_rows
    return out


# ------------------------------------------------------------------------------------------ the run

class Run:
    """Everything a step needs, built once: model, tokenizer, data, optimizer, sampler."""

    def __init__(self, cfg: RunConfig, info):
        self.cfg = cfg
        self.info = info
        torch.manual_seed(cfg.train.seed)
        self.model, self.tokenizer = load_policy(cfg.model.path, dtype=cfg.model.dtype, device=info.device)
        if cfg.model.gradient_checkpointing:
            # transformers 5 renamed it; the old name warns and goes in v6
            enable = getattr(self.model, "activation_checkpointing_enable", None) \
                or self.model.gradient_checkpointing_enable
            enable()
        self.model.train()
        self.reference = None
        if cfg.algo.kl_coef > 0:
            self.reference, _ = load_policy(cfg.model.path, dtype=cfg.model.dtype, device=info.device)
            self.reference.eval().requires_grad_(False)
        self.pad_id = self.tokenizer.pad_token_id
        self.eos_ids = {self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set()
        self.temperature = cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0
        self.rows, self.prompt_tokens, self.skipped = load_data(cfg, self.tokenizer)
        self.eval_rows, self.eval_tokens = [], []
        if cfg.eval.path:
            rows, tokens, _ = load_data(cfg, self.tokenizer, cfg.eval.path)
            self.eval_rows, self.eval_tokens = rows[:cfg.eval.max_prompts], tokens[:cfg.eval.max_prompts]
        self.sampler = PromptSampler(len(self.rows), cfg.data.seed)
        self.reward_fns = [(resolve(spec.name), spec.weight) for spec in cfg.rewards.functions]
        # fused: one kernel over all parameters; the default per-tensor loop cost ~15 ms a step for 2.4 M params on CPU
        self.optimizer = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=cfg.train.lr,
                                           betas=tuple(cfg.train.betas), weight_decay=cfg.train.weight_decay,
                                           fused=True)
        warm = cfg.train.warmup_steps
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / warm) if warm > 0 else 1.0)

    def trainer_state(self, step: int) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "lr_scheduler": self.lr_scheduler.state_dict(),
                "sampler": self.sampler.state_dict(), "rng": checkpoint.rng_state(), "step": step}

    def load_trainer_state(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        self.sampler.load_state_dict(state["sampler"])
        checkpoint.set_rng_state(state["rng"])


def load_data(cfg: RunConfig, tokenizer, path: str | None = None) -> tuple[list[dict], list[list[int]], int]:
    """Prompt rows of `path` (default data.path), their token ids, and how many were skipped as too long."""
    path = cfg.data.path if path is None else path
    if not path:
        raise UsageError("data.path: empty; give a .jsonl/.parquet file or a dataset directory")
    rows = load_prompts(path, prompt_field=cfg.data.prompt_field, answer_field=cfg.data.answer_field,
                        extra_fields=cfg.data.extra_fields)
    tokens = [encode_prompt(tokenizer, r["prompt"], cfg.model.use_chat_template) for r in rows]
    kept, skipped = filter_by_length(list(range(len(rows))), [len(t) for t in tokens], cfg.data.max_prompt_tokens)
    if not kept:
        raise UsageError(f"data.max_prompt_tokens: got {cfg.data.max_prompt_tokens}; all {len(rows)} prompts "
                         f"of {path} are longer — raise it")
    return [rows[i] for i in kept], [tokens[i] for i in kept], skipped


def preflight(cfg: RunConfig):
    """The plan of `evenrl plan` for the layout this process runs in; an error finding stops the run
    before the model loads, as one line."""
    from evenrl.layout import detect_local, layout_from_env
    from evenrl.plan import make_plan

    # The planner can estimate FSDP and offload (to tell you what would fit); the trainer cannot run them yet.
    for field, value, allowed in (("parallel.sharding", cfg.parallel.sharding, "replicated"),
                                  ("parallel.cpu_offload", cfg.parallel.cpu_offload, "none")):
        if value != allowed:
            raise UsageError(f"{field}: got {value!r}; evenrl train supports {allowed!r} today "
                             f"(evenrl plan estimates {value!r}; the trainer's support is on the roadmap)")
    plan = make_plan(cfg, layout_from_env(os.environ) or detect_local())
    errors = [f for f in plan.findings if f.level == "error"]
    if errors:
        e = errors[0]
        fix = "; ".join(line.strip() for line in e.fix.splitlines() if line.strip())
        more = f" (+{len(errors) - 1} more: run evenrl plan)" if len(errors) > 1 else ""
        raise UsageError(f"plan {e.rule}: {e.message}; fix: {fix}{more}")
    return plan


def train(cfg: RunConfig, *, resume: bool = False) -> Path:
    """Run `cfg.train.steps` RL steps (or continue to them from the latest checkpoint). Returns the run dir."""
    plan = preflight(cfg)
    info = dist.init()
    run_dir = Path(cfg.log.run_dir)
    ckpt_root = run_dir / "checkpoints"
    run = Run(cfg, info)
    start = 0
    if resume:
        found = checkpoint.latest(ckpt_root)
        if found is not None:
            start, state = checkpoint.load(found, run.model)
            run.load_trainer_state(state)
            if dist.is_main():
                print(f"evenrl: resumed from {found} (step {start})", flush=True)
    if dist.is_main():
        write_run_header(run, plan, resumed_from=start)
    log = RunLog(str(run_dir), enabled=dist.is_main(), tensorboard=cfg.log.tensorboard,
                 progress_total=cfg.train.steps, progress=cfg.log.progress, initial_step=start,
                 shown={"reward/mean": "reward", "kl": "kl", "perf/tokens_per_s": "tok/s"})
    # Test hook: simulate a worker killed at the start of a step (first attempt only, so an elastic restart recovers).
    fail_at = int(os.environ.get("EVENRL_TEST_CRASH_AT_STEP", "0"))
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        fail_at = 0
    phases: dict[str, float] = {}
    if run.eval_rows and start == 0:
        log.metrics(0, evaluate(run, run.eval_rows, run.eval_tokens), advance=False)
    for step in range(start + 1, cfg.train.steps + 1):
        if step == fail_at:
            os._exit(17)
        t0 = time.perf_counter()
        metrics, examples = rl_step(step, run)
        metrics["time/step"] = time.perf_counter() - t0  # wall time of the whole step, phases and the rest
        for k, v in metrics.items():
            if k.startswith("time/"):
                phases[k[5:]] = phases.get(k[5:], 0.0) + v
        if run.eval_rows and (step == cfg.train.steps or (cfg.eval.every_steps and step % cfg.eval.every_steps == 0)):
            metrics.update(evaluate(run, run.eval_rows, run.eval_tokens))
        log.metrics(step, metrics)
        if cfg.log.samples_every_steps and step % cfg.log.samples_every_steps == 0:
            log.samples(step, examples)
        if (cfg.checkpoint.every_steps and step % cfg.checkpoint.every_steps == 0) or step == cfg.train.steps:
            if dist.is_main():
                checkpoint.save(ckpt_root, step, model=run.model, trainer_state=run.trainer_state(step),
                                keep=cfg.checkpoint.keep)
            dist.barrier()
    if dist.is_main():
        save_final(run.model, run.tokenizer, run_dir / "final")
    log.close()
    if dist.is_main() and phases:
        print(phase_table(phases, cfg.train.steps - start), flush=True)
    dist.barrier()
    return run_dir


def write_run_header(run: Run, plan, *, resumed_from: int) -> None:
    """Print the plan and dump the resolved config and plan into the run directory (rank 0)."""
    import json

    from evenrl.plan import render

    text = render(plan)
    print(text, flush=True)
    run_dir = Path(run.cfg.log.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(config_to_yaml(run.cfg))
    (run_dir / "plan.txt").write_text(text + "\n")
    (run_dir / "plan.json").write_text(json.dumps(plan.to_dict(), indent=1))
    if resumed_from:
        _truncate_metrics(run_dir / "metrics.jsonl", resumed_from)
    if run.skipped:
        print(f"evenrl: skipped {run.skipped} prompts longer than data.max_prompt_tokens={run.cfg.data.max_prompt_tokens}")


def _truncate_metrics(path: Path, last_step: int) -> None:
    """After a resume, drop metric rows of steps the checkpoint does not contain (they are re-run)."""
    import json

    if not path.exists():
        return
    keep = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= last_step]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(line + "\n" for line in keep))
    os.replace(tmp, path)


def save_final(model, tokenizer, out: Path) -> None:
    """The trained model as a Hugging Face directory (safetensors), written atomically."""
    import shutil

    tmp = out.with_name(f".tmp-{out.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)  # safetensors by default
    tokenizer.save_pretrained(tmp)
    if out.exists():
        shutil.rmtree(out)
    os.rename(tmp, out)


# ------------------------------------------------------------------------------------------ small helpers

PHASES = ["rollout", "reward", "advantage", "exchange", "logprobs", "update"]


def phase_table(seconds: dict[str, float], steps: int) -> str:
    """Rank 0's time per phase summed over the run's steps, so the next speed-up is chosen from data.
    `seconds` holds the phase timers plus "step" (wall time of whole steps); "other" is what no phase covers."""
    total = seconds.get("step", sum(v for k, v in seconds.items() if k != "step"))
    names = [p for p in PHASES if p in seconds] + sorted(k for k in seconds if k not in PHASES and k != "step")
    rows = [(p, seconds[p]) for p in names] + [("other", max(0.0, total - sum(seconds[p] for p in names)))]
    lines = [f"phase breakdown over {steps} step{'s' if steps != 1 else ''} (rank 0):",
             f"  {'phase':<10} {'seconds':>9} {'%':>6}"]
    lines += [f"  {name:<10} {sec:9.2f} {100 * sec / max(total, 1e-9):6.1f}" for name, sec in rows]
    lines.append(f"  {'total':<10} {total:9.2f} {100.0:6.1f}")
    return "\n".join(lines)


class Timer:
    def __init__(self):
        self.seconds: dict[str, float] = {}

    def __call__(self, name: str):
        timer = self

        class _Ctx:
            def __enter__(self):
                self.t = time.perf_counter()

            def __exit__(self, *exc):
                timer.seconds[name] = timer.seconds.get(name, 0.0) + time.perf_counter() - self.t

        return _Ctx()


def _ragged(rows: list[torch.Tensor], dtype) -> "object":
    from evenrl.batch import Ragged

    if rows:
        return Ragged(torch.cat(rows).to(dtype), torch.tensor([len(r) for r in rows], dtype=torch.long))
    return Ragged(torch.zeros(0, dtype=dtype), torch.zeros(0, dtype=torch.long))


def singles(n: int) -> list[list[int]]:
    return [[i] for i in range(n)]


def flat(micro: list[list[list[int]]]) -> list[list[int]]:
    return [rows for mb in micro for rows in mb]


def example_rows(local: Batch, k: int = 4) -> list[dict]:
    """A few of this rank's completions for samples.jsonl."""
    return [{"row_id": local["row_id"][i], "completion": local["completion"][i],
             "reward": float(local["reward"][i])} for i in range(min(k, len(local)))]


if __name__ == "__main__":
    import sys

    from evenrl.cli import main

    sys.exit(main(["train", *sys.argv[1:]]))
