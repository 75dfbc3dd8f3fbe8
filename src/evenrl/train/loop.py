"""`evenrl train`: set-up, the loop over RL steps, checkpoints and the run directory. The step itself is
`evenrl.train.step.rl_step`.

    evenrl train examples/demo.yaml                          # one process
    evenrl train examples/demo.yaml --nproc-per-node 3       # three local processes (torch.distributed.run)
    evenrl train examples/demo.yaml --resume                 # continue from the run directory's latest checkpoint
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from evenrl.config import RunConfig, config_to_yaml
from evenrl.core.staleness import push_steps, versions_needed
from evenrl.distributed import collectives as dist
from evenrl.engines import make_engine
from evenrl.errors import RunStopped, UsageError
from evenrl.distributed.sharding import shard
from evenrl.distributed.weights import full_weights
from evenrl.models.loading import load_policy, with_value_head
from evenrl.rewards import resolve
from evenrl.train import checkpoint, rundir
from evenrl.train.data import PromptSampler, load_data
from evenrl.train.evaluate import evaluate
from evenrl.train.runlog import RunLog, read_metrics
from evenrl.train.step import load_pushed, rl_step, serve_rollout
from evenrl.train.update import prepare_model


class Run:
    """Everything a step needs, built once: model (and critic), tokenizer, data, optimizers, sampler."""

    def __init__(self, cfg: RunConfig, info):
        self.cfg = cfg
        self.info = info
        torch.manual_seed(cfg.train.seed)
        if dist.is_rollout_rank():  # generates only: one whole copy in the engine's dtype, written by each push
            self.model, self.tokenizer = load_policy(cfg.model.path, dtype=cfg.model.dtype, device=info.device)
            self.critic = None
        else:
            self.model, self.tokenizer = trainable_model(cfg, cfg.model.path, info)
            self.critic = None
            if cfg.algo.advantage == "gae":  # built like the policy: whatever is applied to one applies to the other
                self.critic, _ = trainable_model(cfg, cfg.critic.path or cfg.model.path, info,
                                                 head=lambda m: with_value_head(m, cfg.train.seed))
        self.model.train()
        self.reference = None
        if cfg.algo.kl_coef > 0 and not dist.is_rollout_rank():  # frozen: held in the compute dtype, no master copy
            self.reference, _ = load_policy(cfg.model.path, dtype=cfg.model.dtype, device=info.device)
            self.reference.eval().requires_grad_(False)
            if cfg.parallel.sharding == "fsdp":
                shard(self.reference, offload=cfg.parallel.cpu_offload == "full")
        self.pad_id = self.tokenizer.pad_token_id
        self.eos_ids = {self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set()
        self.temperature = cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0
        self.model_dtype = getattr(torch, cfg.model.dtype)
        # with reserved rollout ranks a trainer generates nothing: no engine (no second copy of the weights)
        self.engine = None if dist.rollout_ranks() and not dist.is_rollout_rank() else \
            make_engine(cfg, self.model, eos_token_ids=self.eos_ids, pad_token_id=self.pad_id, device=info.device)
        # generating ahead, nobody waits for a push: trainer 0 sends from a host copy in the background
        self.sender = dist.WeightSender() if (dist.rollout_ranks() and dist.is_main()
                                              and cfg.rollout.max_staleness > 0) else None
        self.rows, self.prompt_tokens, self.skipped = load_data(cfg, self.tokenizer)
        self.eval_rows, self.eval_tokens = [], []
        if cfg.eval.path:
            rows, tokens, _ = load_data(cfg, self.tokenizer, cfg.eval.path)
            self.eval_rows, self.eval_tokens = rows[:cfg.eval.max_prompts], tokens[:cfg.eval.max_prompts]
        self.sampler = PromptSampler(len(self.rows), cfg.data.seed)
        self.reward_fns = [(resolve(spec.name), spec.weight) for spec in cfg.rewards.functions]
        self.optimizer, self.lr_scheduler = adamw(self.model, cfg, cfg.train.lr, cfg.train.warmup_steps)
        self.critic_optimizer = self.critic_lr_scheduler = None
        if self.critic is not None:
            self.critic_optimizer, self.critic_lr_scheduler = adamw(self.critic, cfg, cfg.critic.lr,
                                                                    cfg.critic.warmup_steps)
        self.ckpt_root = Path(cfg.log.run_dir) / "checkpoints"
        self.resume_at(0, None)

    def resume_at(self, start: int, found: Path | None) -> None:
        """Where this run starts: after step `start`, from checkpoint `found` (None: from the beginning). With
        max_staleness >= 1 that fixes which pushed versions the checkpoints to come must carry."""
        cfg, k = self.cfg, self.cfg.rollout.max_staleness
        self.start, self.resumed_from = start, found
        every, last = cfg.checkpoint.every_steps, cfg.train.steps
        saves = [c for c in range(start + 1, last + 1) if (every and c % every == 0) or c == last]
        self.versions_to_keep = {v for c in saves for v in versions_needed(c, k)}

    def extra_models(self) -> dict:
        """Trained models besides the policy, with their optimizers, saved and restored with each checkpoint by
        name."""
        return {"critic": (self.critic, self.critic_optimizer)} if self.critic is not None else {}

    def trainer_state(self, step: int) -> dict:
        state = {"lr_scheduler": self.lr_scheduler.state_dict(),
                 "sampler": self.sampler.state_dict(), "rng": checkpoint.rng_state(), "step": step}
        if self.critic is not None:
            state["critic_lr_scheduler"] = self.critic_lr_scheduler.state_dict()
        return state

    def load_trainer_state(self, state: dict) -> None:
        self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        if self.critic is not None:
            self.critic_lr_scheduler.load_state_dict(state["critic_lr_scheduler"])
        self.sampler.load_state_dict(state["sampler"])
        checkpoint.set_rng_state(state["rng"])


def trainable_model(cfg: RunConfig, path: str, info, head=None):
    """(model, tokenizer) from `path`, ready to train: the policy, or with `head` (a function of the model) the
    critic, so both go through the same construction."""
    # fp32 master weights whatever model.dtype says: prepare_model sets the compute precision
    model, tokenizer = load_policy(path, dtype="float32", device=info.device)
    if head is not None:
        model = head(model)
    prepare_model(model, cfg)
    model.train()
    return model, tokenizer


def adamw(model, cfg: RunConfig, lr: float, warmup_steps: int):
    """(AdamW over the model's trainable parameters, linear warm-up over `warmup_steps` optimizer steps)."""
    # fused: one kernel over all parameters; the default per-tensor loop cost ~15 ms a step for 2.4 M params on CPU
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr,
                                  betas=tuple(cfg.train.betas), weight_decay=cfg.train.weight_decay, fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup_steps) if warmup_steps > 0 else 1.0)
    return optimizer, scheduler


def preflight(cfg: RunConfig):
    """The plan of `evenrl plan` for the layout this process runs in; an error finding stops the run
    before the model loads, as one line."""
    from evenrl.planner.layout import detect_local, layout_from_env
    from evenrl.planner.plan import make_plan

    if cfg.rollout.engine == "vllm":
        from evenrl.engines.vllm_engine import require

        require()
    plan = make_plan(cfg, layout_from_env(os.environ) or detect_local())
    errors = [f for f in plan.findings if f.level == "error"]
    if errors:
        e = errors[0]
        fix = "; ".join(line.strip() for line in e.fix.splitlines() if line.strip())
        more = f" (+{len(errors) - 1} more: run evenrl plan)" if len(errors) > 1 else ""
        raise UsageError(f"plan {e.rule}: {e.message}; fix: {fix}{more}")
    return plan


def train(cfg: RunConfig, *, resume: bool = False, overwrite: bool = False, restarted: bool = False) -> Path:
    """Run `cfg.train.steps` RL steps (or continue to them from the latest checkpoint). Returns the run dir.
    restarted: this worker was started again by the elastic agent (continue from a checkpoint if there is one)."""
    run_dir = Path(cfg.log.run_dir)
    rundir.check(run_dir, resume=resume, overwrite=overwrite, restarted=restarted)
    if resume or restarted:
        read_metrics(run_dir)  # a broken line is one error now, not a traceback once the header is half-written
    plan = preflight(cfg)
    info = dist.init(timeout=cfg.parallel.collective_timeout_s, rollout_devices=cfg.parallel.rollout_devices)
    if dist.is_main():
        rundir.prepare(run_dir, overwrite=overwrite and not restarted)
    dist.barrier()
    ckpt_root = run_dir / "checkpoints"
    run = Run(cfg, info)
    start = 0
    found = checkpoint.latest(ckpt_root) if resume or restarted else None
    if dist.is_rollout_rank():
        serve_rollouts(run, found)
        dist.barrier_all()  # wait for the trainers to finish and save before leaving the group
        return run_dir
    if found is not None:
        start, state = checkpoint.load(found, run.model, run.optimizer, extra=run.extra_models())
        run.resume_at(start, found)
        try:
            run.load_trainer_state(state)
        except (KeyError, ValueError, TypeError, IndexError) as e:
            raise UsageError(f"{found / 'trainer.pt'}: does not fit this run ({type(e).__name__}: "
                             f"{str(e).splitlines()[0][:120] if str(e) else 'missing state'}); it was saved by "
                             "another model or optimizer, or is damaged") from None
        if dist.is_main():
            print(f"evenrl: resumed from {found} (step {start})", flush=True)
    elif restarted and dist.is_main():
        print("evenrl: restarted before the first checkpoint; starting over from step 1", flush=True)
    if dist.is_main():
        write_run_header(run, plan, resumed_from=start if resume or restarted else None)
    log = RunLog(str(run_dir), enabled=dist.is_main(), tensorboard=cfg.log.tensorboard,
                 progress_total=cfg.train.steps, progress=cfg.log.progress, initial_step=start,
                 shown={"reward/mean": "reward", "kl": "kl", "perf/tokens_per_s": "tok/s"})
    # Test hook: simulate a worker killed at the start of a step (first attempt only, so an elastic restart recovers).
    fail_at = 0 if restarted else int(os.environ.get("EVENRL_TEST_CRASH_AT_STEP", "0"))
    phases: dict[str, float] = {}
    idle = Idle()
    if run.eval_rows and start == 0:
        log.metrics(0, evaluate(run, run.eval_rows, run.eval_tokens), advance=False)
    for step in range(start + 1, cfg.train.steps + 1):
        if step == fail_at:
            os._exit(17)
        t0 = time.perf_counter()
        try:
            metrics, examples = rl_step(step, run)
        except RunStopped as e:  # every rank stops here; nothing of this step is saved
            last = checkpoint.latest(ckpt_root)
            raise RunStopped(f"step {step}: {e}; last good checkpoint: {last or 'none yet'}") from None
        metrics["time/step"] = time.perf_counter() - t0  # wall time of the whole step, phases and the rest
        for k, v in metrics.items():
            if k.startswith("time/"):
                phases[k[5:]] = phases.get(k[5:], 0.0) + v
        if dist.is_main():
            idle.see(step, metrics)
            if metrics.get("sampling/groups_short", 0) > 0:
                kept = cfg.data.prompts_per_step - metrics["sampling/groups_short"]
                print(f"evenrl: warning: step {step}: dynamic sampling kept {kept} of {cfg.data.prompts_per_step} "
                      f"groups ({metrics['samples']} samples) after {metrics['sampling/rounds']} rounds "
                      f"(algo.max_generation_rounds); " + ("the step trains on those" if kept else
                                                          "nothing to train on in this step"), flush=True)
        if run.eval_rows and (step == cfg.train.steps or (cfg.eval.every_steps and step % cfg.eval.every_steps == 0)):
            dist.mark(f"step {step} evaluate")
            metrics.update(evaluate(run, run.eval_rows, run.eval_tokens))
        log.metrics(step, metrics)
        if cfg.log.samples_every_steps and step % cfg.log.samples_every_steps == 0:
            log.samples(step, examples)
        if (cfg.checkpoint.every_steps and step % cfg.checkpoint.every_steps == 0) or step == cfg.train.steps:
            dist.mark(f"step {step} checkpoint")
            checkpoint.save(ckpt_root, step, model=run.model, optimizer=run.optimizer,
                            trainer_state=run.trainer_state(step), keep=cfg.checkpoint.keep,
                            extra=run.extra_models(), versions=versions_needed(step, cfg.rollout.max_staleness),
                            max_staleness=cfg.rollout.max_staleness)
    if run.sender is not None:
        run.sender.wait()
    dist.mark("final save")
    checkpoint.save_final(run.model, run.tokenizer, run_dir / "final")
    log.close()
    if dist.is_main() and phases:
        print(phase_table(phases, cfg.train.steps - start), flush=True)
        idle.summary(cfg.train.steps - start)
    dist.barrier_all()
    return run_dir


def serve_rollouts(run: Run, found: Path | None) -> None:
    """A reserved rollout rank's whole run: per step, the step's prompts (the same PromptSampler as the trainers,
    so no prompt is sent), the weights of the version that samples it (pushed by the trainers, received in the
    background), this replica's samples out. With max_staleness k it runs up to k steps ahead of the trainers:
    step t needs the version after step t-1-k, which the trainers push as soon as they have it. It saves and
    logs nothing."""
    cfg, start = run.cfg, 0
    if found is not None:  # only where the run continues and which prompts come next; the weights come pushed
        start = checkpoint.read_meta(found)["step"]
        run.sampler.load_state_dict(torch.load(found / "trainer.pt", map_location="cpu", weights_only=True)["sampler"])
    due = push_steps(start, cfg.train.steps, cfg.rollout.max_staleness)
    layout = [[(name, t.shape, t.dtype) for name, t in bucket]
              for bucket in full_weights(run.model, dtype=run.model_dtype)]
    receiver = dist.WeightReceiver(layout, len(due))
    stall_at = int(os.environ.get("EVENRL_TEST_ROLLOUT_STALLS_AT_STEP", "0"))  # test hook: a rollout rank hangs
    for step in range(start + 1, cfg.train.steps + 1):
        if step == stall_at:
            time.sleep(3600)
        prompts = run.sampler.next_prompts(cfg.data.prompts_per_step)
        if step in due:
            dist.mark(f"step {step} weights (rollout rank)")
            load_pushed(run, receiver.next())
        serve_rollout(run, step, prompts)
    dist.finish_sends()
    receiver.join()


class Idle:
    """Steps that learn nothing: every sample's advantage is 0 (each group's rewards were all equal, e.g. a 0/1
    reward the model never or always earns), so the policy gradient is zero. Warns at the first step of each such
    streak, and once at the end when it happened at all."""

    def __init__(self):
        self.steps: list[int] = []

    def see(self, step: int, metrics: dict) -> None:
        if metrics.get("samples", 0) and metrics.get("advantage/abs_mean", 1.0) == 0.0:
            if not self.steps or self.steps[-1] != step - 1:
                print(f"evenrl: warning: step {step} learned nothing: every group's rewards were equal, so all "
                      f"{metrics['samples']} samples have advantage 0 (check the reward on a few samples.jsonl rows)",
                      flush=True)
            self.steps.append(step)

    def summary(self, steps: int) -> None:
        if self.steps:
            print(f"evenrl: note: {len(self.steps)} of {steps} steps learned nothing (all advantages 0); "
                  "the reward does not tell this model's samples apart", flush=True)


def write_run_header(run: Run, plan, *, resumed_from: int | None) -> None:
    """Print the plan and dump the resolved config and plan into the run directory (rank 0)."""
    from evenrl.planner.render import render

    text = render(plan)
    print(text, flush=True)
    run_dir = Path(run.cfg.log.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(config_to_yaml(run.cfg))
    (run_dir / "plan.txt").write_text(text + "\n")
    (run_dir / "plan.json").write_text(json.dumps(plan.to_dict(), indent=1))
    if resumed_from is not None:  # continuing (or restarted before the first checkpoint: from 0)
        _truncate_metrics(run_dir, resumed_from)
    if run.skipped:
        print(f"evenrl: skipped {run.skipped} prompts longer than data.max_prompt_tokens={run.cfg.data.max_prompt_tokens}")


def _truncate_metrics(run_dir: Path, last_step: int) -> None:
    """After a resume, drop metric rows of steps the checkpoint does not contain (they are re-run); from step 0
    (a restart before the first checkpoint) that is every row, the step-0 evaluation included."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return
    keep = [row for row in read_metrics(run_dir) if row["step"] <= last_step] if last_step > 0 else []
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(row) + "\n" for row in keep))  # as RunLog writes them
    os.replace(tmp, path)


PHASES = ["weights", "rollout", "reward", "values", "advantage", "exchange", "logprobs", "update"]


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
