"""evenrl vs TRL's GRPOTrainer on identical GRPO work, side by side, on CPU (or one GPU: benchmarks/gpu_vs_trl.py).

    .venv/bin/pip install -e '.[bench]'          # TRL, accelerate, datasets (make bench does it)
    .venv/bin/python benchmarks/grpo_vs_trl.py                      # both workloads, 1 and 2 processes, 3 pairs
    .venv/bin/python benchmarks/grpo_vs_trl.py --workloads small --nprocs 1 --pairs 3
    .venv/bin/python benchmarks/grpo_vs_trl.py --plot docs/bench_steps.png     # also draw where each step goes

Both frameworks load the same tiny Qwen2 directory (made here, ~2.4 M parameters, character tokenizer), get the same
synthetic prompts ("a+b=") and the same reward (share of digit characters in the completion, so a random model gets
varied scores and can learn), and do the same work per optimizer step: prompts x samples per prompt completions of
at most max_new_tokens tokens, one optimizer step per generation batch, micro-batches bounded to the memory of 32
completions (TRL: 32 rows; evenrl: the same padded-token cap), AdamW at a constant learning rate, GRPO advantages
scaled by the group std, token-mean loss over the whole batch, clip 0.2, no KL, temperature 1, top-p 1, fp32, no
gradient checkpointing, the same thread count per process. Two processes: `evenrl train --nproc-per-node 2` and
TRL under `torchrun --nproc-per-node=2` (see trl_command for why not `accelerate launch --cpu`).

Runs alternate A B A B (TRL, evenrl, ...), each in a fresh subprocess; pair i uses seed i for both. The first
`warmup` steps of each run are not timed; each following step's wall time is taken (TRL: between its trainer's
on_step_end callbacks; evenrl: `time/step` in metrics.jsonl, the whole rl_step), and a run's samples/s is samples per
step over its median step time (tokens/s likewise: prompt + completion tokens). The machine is shared and noisy, so
what counts is the per-pair ratio evenrl/TRL and its median. "generate+score" is TRL's
_generate_and_score_completions (sampling, rewards, advantages), evenrl's rollout + reward + advantage phases; the
rest of a step is the gradient update. Prints numbers only; nothing asserts speed.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

WORKLOADS = {  # name: (prompts per step, samples per prompt, max new tokens)
    "small": (4, 8, 16),
    "large": (32, 8, 128),
    "large-binary": (32, 8, 128),
    "gpu": (16, 4, 128),  # benchmarks/gpu.py's batch, on its 0.5B shape (gpu_vs_trl.py)
    "gpu-tiny": (4, 4, 16),  # gpu.py --tiny's batch: gpu_suite.py --tiny's rehearsal of "gpu" on CPU
}
# The two workloads use a graded reward; "large-binary" (opt-in) is the large one with a 0/1 reward, as in
# verifiable-reward RL, where whole groups score alike and get advantage 0.
REWARD = {"large-binary": "starts_with_digit"}
MICRO_ROWS = 32  # completions per forward/backward micro-batch, both frameworks
LR = 1e-3  # large for RL, so that a tiny random model's reward moves within a few steps
MODEL = {"hidden": 256, "layers": 4, "heads": 8, "seed": 0}


def digit_fraction(completion: str, sample: dict) -> float:
    """The shared reward: share of characters that are digits (evenrl calls it as grpo_vs_trl:digit_fraction)."""
    return sum(c.isdigit() for c in completion) / max(len(completion), 1)


def starts_with_digit(completion: str, sample: dict) -> float:
    """0/1 reward of "large-binary": ~10% of a random model's completions start with a digit, so many groups of 8
    score all 0 (and, as it learns, all 1)."""
    return float(completion[:1].isdigit())


# ------------------------------------------------------------------------------------------ assets


def make_assets(out: Path, shape: str) -> tuple[Path, Path, float]:
    """(model dir, data file, mean prompt tokens): the tiny model and 'a+b=' prompts, or (shape: one of
    benchmarks/gpu.py's SHAPES) that shape with random weights and gpu.py's 40-62-character sums. Both tokenizers
    give one token per character of these prompts."""
    from evenrl.testing import make_tiny_model

    model = out / f"model-{shape}"
    data = out / f"prompts-{shape}.jsonl"
    if shape == "tiny":
        from evenrl.demo import write_addition_data

        if not (model / "config.json").exists():
            make_tiny_model(str(model), **MODEL)
        write_addition_data(data)
    else:
        import gpu

        if not (model / "config.json").exists():
            model.mkdir(parents=True, exist_ok=True)
            gpu.make_model(model, gpu.SHAPES[shape])
        gpu.write_data(data)
    prompts = [json.loads(x)["prompt"] for x in data.read_text().splitlines() if x.strip()]
    return model, data, sum(map(len, prompts)) / len(prompts)


def n_params(model_dir: Path) -> int:
    from safetensors.torch import load_file

    return sum(t.numel() for t in load_file(str(model_dir / "model.safetensors")).values())


def batch_layout(workload: str, nproc: int) -> dict:
    """TRL's batch knobs for one optimizer step per generation batch of prompts x samples completions."""
    prompts, samples, _ = WORKLOADS[workload]
    total = prompts * samples
    per_device = min(MICRO_ROWS, total // nproc)
    accum = total // (per_device * nproc)
    assert per_device * accum * nproc == total, (workload, nproc)
    return {"per_device_train_batch_size": per_device, "gradient_accumulation_steps": accum,
            "steps_per_generation": accum, "generation_batch_size": total}


# ------------------------------------------------------------------------------------------ TRL worker


def trl_worker(spec: dict) -> None:
    """Runs under torchrun (or plain python for 1 process): one TRL GRPO run, results to spec['out'] (rank 0)."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    rows = [json.loads(x) for x in Path(spec["data"]).read_text().splitlines() if x.strip()]
    dataset = Dataset.from_list(rows)

    seen = []  # completions this process scored per call (one call per generation batch here)

    def reward(completions, **kw):
        seen.append(len(completions))
        return [score(c, {}) for c in completions]

    score = globals()[spec["reward"]]

    class Clock(TrainerCallback):
        def __init__(self):
            self.ends = []

        def on_step_end(self, args, state, control, **kw):
            self.ends.append(time.perf_counter())

    lay = spec["layout"]
    args = GRPOConfig(
        output_dir=spec["run_dir"], use_cpu=spec["device"] == "cpu", bf16=spec["dtype"] == "bfloat16", fp16=False,
        max_steps=spec["steps"], learning_rate=spec["lr"], lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, max_grad_norm=1.0, seed=spec.get("seed", 0),
        per_device_train_batch_size=lay["per_device_train_batch_size"],
        gradient_accumulation_steps=lay["gradient_accumulation_steps"],
        steps_per_generation=lay["steps_per_generation"],
        num_generations=spec["samples"], max_completion_length=spec["max_new"],
        temperature=1.0, top_p=1.0, beta=0.0, num_iterations=1, epsilon=0.2,
        loss_type="dapo", scale_rewards="group",
        gradient_checkpointing=False,  # TRL's default is True; evenrl's is off: same compute for both
        logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
    )
    clock = Clock()
    trainer = GRPOTrainer(model=spec["model"], reward_funcs=reward, args=args, train_dataset=dataset,
                          callbacks=[clock])
    gen_times = []  # generation + rewards + advantages, once per optimizer step here
    generate_and_score = trainer._generate_and_score_completions

    def timed_generate_and_score(*a, **kw):
        t0 = time.perf_counter()
        out = generate_and_score(*a, **kw)
        gen_times.append(time.perf_counter() - t0)
        return out

    trainer._generate_and_score_completions = timed_generate_and_score
    trainer.train()
    if trainer.accelerator.is_main_process:
        logs = [h for h in trainer.state.log_history if "reward" in h]
        Path(spec["out"]).write_text(json.dumps({
            "ends": clock.ends, "gen": gen_times, "reward": [h["reward"] for h in logs],
            "completion_len": [h["completions/mean_length"] for h in logs],  # mean over all processes' completions
            "threads": torch.get_num_threads(), "world": trainer.accelerator.num_processes, "scored": seen,
            "settings": {k: getattr(args, k) for k in SETTINGS_SHOWN},
        }))


SETTINGS_SHOWN = ["per_device_train_batch_size", "gradient_accumulation_steps", "steps_per_generation",
                  "generation_batch_size", "num_generations", "max_completion_length", "learning_rate",
                  "lr_scheduler_type", "beta", "num_iterations", "loss_type", "scale_rewards", "temperature",
                  "top_p", "use_cpu", "bf16", "gradient_checkpointing"]


# ------------------------------------------------------------------------------------------ runs


def env_for(threads: int) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
            "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1", "ACCELERATE_DISABLE_RICH": "1",
            "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}


def trl_command(spec_path: Path, nproc: int) -> list[str]:
    me = [str(Path(__file__).resolve()), "--trl-worker", str(spec_path)]
    if nproc == 1:
        return [sys.executable, *me]
    # `accelerate launch --cpu --num_processes 2` formed no process group here (accelerate's multi-CPU launch goes
    # through MPI): each worker reported world size 1 and trained alone on half the batch. Under torchrun,
    # TrainingArguments' PartialState reads RANK/WORLD_SIZE and joins one gloo group (world 2, DDP).
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    return [torchrun, "--standalone", f"--nproc-per-node={nproc}", *me]


def evenrl_command(cfg_path: Path, nproc: int) -> list[str]:
    return [sys.executable, "-m", "evenrl.cli", "train", str(cfg_path), "--nproc-per-node", str(nproc)]


def evenrl_config(path: Path, model: Path, data: Path, run_dir: Path, workload: str, steps: int, seed: int,
                  prof: dict) -> None:
    prompts, samples, max_new = WORKLOADS[workload]
    # at most 32 completions per micro-batch, like TRL
    cap = MICRO_ROWS * (prof["max_prompt_tokens"] + max_new)
    path.write_text(f"""# written by benchmarks/grpo_vs_trl.py
model: {{path: {model}, dtype: {prof["dtype"]}}}
data: {{path: {data}, prompts_per_step: {prompts}, max_prompt_tokens: {prof["max_prompt_tokens"]}, seed: {seed}}}
rollout: {{samples_per_prompt: {samples}, max_new_tokens: {max_new}, temperature: 1.0, top_p: 1.0,
          decoder: {prof["decoder"]}}}
rewards: {{functions: [{{name: 'grpo_vs_trl:{REWARD.get(workload, "digit_fraction")}'}}], isolate: false}}
algo: {{advantage: grpo, std_scale: group, loss_aggregation: token-mean, clip_low: 0.2, clip_high: 0.2, kl_coef: 0.0}}
train: {{steps: {steps}, seed: {seed}, lr: {LR}, weight_decay: 0.0, max_grad_norm: 1.0,
        token_cap_per_micro_batch: {cap}}}
log: {{run_dir: {run_dir}, progress: false, tensorboard: false, samples_every_steps: 0}}
""")


def run_one(kind: str, workload: str, nproc: int, warmup: int, steps: int, threads: int, out: Path,
            model: Path, data: Path, tag: str, verbose: bool, seed: int, prof: dict,
            timeout: float | None = None) -> dict:
    """One run of `kind` (trl or evenrl); timeout: seconds before the run is killed (subprocess.TimeoutExpired,
    no retry: gpu_suite.py's deadline)."""
    prompts, samples, max_new = WORKLOADS[workload]
    run_dir = out / f"{kind}-{workload}-p{nproc}-{tag}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    total_steps = warmup + steps
    if kind == "trl":
        spec = {"model": str(model), "data": str(data), "run_dir": str(run_dir), "out": str(run_dir / "result.json"),
                "steps": total_steps, "lr": LR, "samples": samples, "seed": seed, "max_new": max_new,
                "reward": REWARD.get(workload, "digit_fraction"), "device": prof["device"], "dtype": prof["dtype"],
                "layout": batch_layout(workload, nproc)}
        spec_path = run_dir / "spec.json"
        spec_path.write_text(json.dumps(spec))
        cmd = trl_command(spec_path, nproc)
    else:
        cfg = run_dir / "config.bench.yaml"
        evenrl_config(cfg, model, data, run_dir / "run", workload, total_steps, seed, prof)
        cmd = evenrl_command(cfg, nproc)
    for attempt in (1, 2):  # a worker crash (seen once: TRL rank 1 aborted at teardown under torchrun) gets one retry
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, env=env_for(threads), capture_output=True, text=True, check=False,
                              timeout=timeout)
        wall = time.perf_counter() - t0
        (run_dir / "stdout.txt").write_text(proc.stdout)
        (run_dir / "stderr.txt").write_text(proc.stderr)
        if proc.returncode == 0:
            break
        if attempt == 1:
            print(f"   {kind} run failed (exit {proc.returncode}); retrying it once", flush=True)
    if proc.returncode != 0:
        raise SystemExit(f"{kind} failed (exit {proc.returncode}); command:\n  {shlex.join(cmd)}\n"
                         f"stderr tail:\n{proc.stderr[-3000:]}")
    if verbose and kind == "evenrl":
        tail = proc.stdout[proc.stdout.rfind("phase breakdown"):] if "phase breakdown" in proc.stdout else ""
        print(tail.rstrip())
    # Per timed step: wall seconds, tokens (prompt + completion), seconds of generation + reward + advantage.
    if kind == "trl":
        res = json.loads((run_dir / "result.json").read_text())
        ends, rewards = res["ends"], res["reward"]
        secs = [ends[i] - ends[i - 1] for i in range(warmup, total_steps)]  # step i+1 ends at ends[i]
        # prompts: their mean length in tokens; completions/mean_length is over all processes
        tokens = [prompts * samples * (prof["prompt_tokens"] + n) for n in res["completion_len"][warmup:total_steps]]
        gen = res["gen"][warmup:total_steps]
        extra = {"settings": res["settings"], "threads": res["threads"]}
        per_step = res["world"] * res["scored"][0]
        if res["world"] != nproc or per_step != prompts * samples:  # not the same work: refuse to compare
            raise SystemExit(f"TRL ran {res['world']} process(es) scoring {per_step} completions per step; "
                             f"expected {nproc} and {prompts * samples}: {shlex.join(cmd)}")
    else:
        rows = [json.loads(x) for x in (run_dir / "run" / "metrics.jsonl").read_text().splitlines() if x.strip()]
        timed = rows[warmup:total_steps]
        secs = [r["time/step"] for r in timed]
        # perf/tokens_per_s divides the step's tokens by the sum of its phase timers
        tokens = [r["perf/tokens_per_s"] * sum(v for k, v in r.items() if k.startswith("time/") and k != "time/step")
                  for r in timed]
        gen = [r["time/rollout"] + r["time/reward"] + r["time/advantage"] for r in timed]
        rewards = [r["reward/mean"] for r in rows]
        extra = {}
    # Medians over steps: one step slowed by a neighbour on the shared cores does not decide the run.
    step_s = statistics.median(secs)
    last = rewards[-min(3, len(rewards)):]
    return dict(kind=kind, cmd=cmd, samples_per_s=prompts * samples / step_s,
                tokens_per_s=statistics.median(t / x for t, x in zip(tokens, secs)), step_s=step_s,
                gen_s=statistics.median(gen), reward_end=sum(last) / len(last), reward_first=rewards[0], wall=wall,
                **extra)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default="small,large", help="comma list of: " + ", ".join(WORKLOADS))
    p.add_argument("--nprocs", default="1,2", help="comma list of process counts")
    p.add_argument("--pairs", type=int, default=3, help="A/B pairs per workload and process count (>= 3 advised)")
    p.add_argument("--steps-small", type=int, default=10, help="timed steps, small workload")
    p.add_argument("--steps-large", type=int, default=3, help="timed steps, large workload")
    p.add_argument("--warmup-small", type=int, default=2, help="untimed steps at the start of every small run")
    p.add_argument("--warmup-large", type=int, default=1, help="untimed steps at the start of every large run")
    p.add_argument("--cores", type=int, default=os.cpu_count() or 1,
                   help="threads per process = cores // processes, the same for both frameworks")
    p.add_argument("--out", default="runs/bench_trl", help="scratch directory (model, data, run dirs)")
    p.add_argument("--verbose", action="store_true", help="print evenrl's phase breakdown of every run")
    p.add_argument("--plot", help="also draw seconds per step (generate+score vs update) of both to this PNG")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where both train (TRL: use_cpu)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="both: fp32, or bf16 autocast over fp32 master weights (TRL bf16=True, evenrl model.dtype)")
    p.add_argument("--decoder", default="auto", help="evenrl's rollout.decoder (auto, lean, static, forward)")
    p.add_argument("--shape", default="tiny", help="tiny (2.4 M parameters, 'a+b=') or one of benchmarks/gpu.py's "
                                                   "SHAPES (random weights, 40-62-token sums)")
    p.add_argument("--trl-worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.trl_worker:
        trl_worker(json.loads(Path(args.trl_worker).read_text()))
        return 0
    try:
        import trl
    except ImportError:
        print("TRL is not installed: .venv/bin/pip install -e '.[bench]'  (or make bench)")
        return 1
    import torch
    import transformers

    out = (ROOT / args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    model, data, prompt_tokens = make_assets(out, args.shape)
    prof = {"device": args.device, "dtype": args.dtype, "decoder": args.decoder, "prompt_tokens": prompt_tokens,
            "max_prompt_tokens": 8 if args.shape == "tiny" else 64}
    where = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(f"evenrl vs TRL {trl.__version__} GRPO on {where} (torch {torch.__version__}, transformers "
          f"{transformers.__version__}, {os.cpu_count()} cores)")
    print(f"model: {model} ({args.shape} Qwen2, {n_params(model) / 1e6:.2f} M parameters); data: {data} (prompts of "
          f"{prompt_tokens:.1f} tokens on average); reward: digit share of the completion (large-binary: 1 if the "
          f"completion starts with a digit, else 0); evenrl rollout.decoder={args.decoder}")
    print(f"same for both: lr {LR} constant, AdamW (0.9, 0.999), no weight decay, grad clip 1.0, no KL, "
          "temperature 1, top-p 1, GRPO group-std advantages, token-mean loss over the whole batch (TRL "
          f"loss_type='dapo'), clip 0.2, one optimizer step per generation batch, {args.dtype}, no gradient "
          "checkpointing; "
          f"micro-batches: TRL 32 completions, evenrl token_cap_per_micro_batch = 32 x ({prof['max_prompt_tokens']} + "
          "max new tokens) padded tokens (the same memory bound); rewards scored in the trainer process (evenrl "
          "rewards.isolate=false)")
    table, bars = [], []
    for workload in args.workloads.split(","):
        prompts, samples, max_new = WORKLOADS[workload]
        steps = args.steps_small if workload == "small" else args.steps_large  # "gpu": large
        warmup = args.warmup_small if workload == "small" else args.warmup_large
        for nproc in [int(x) for x in args.nprocs.split(",")]:
            threads = max(1, args.cores // nproc)
            lay = batch_layout(workload, nproc)
            print(f"\n== {workload}: {prompts} prompts x {samples} samples x {max_new} new tokens, "
                  f"{nproc} process(es), "
                  f"{threads} thread(s) each; {warmup} warm-up + {steps} timed steps per run, {args.pairs} pairs")
            print(f"   TRL batch: per_device_train_batch_size={lay['per_device_train_batch_size']} x "
                  f"gradient_accumulation_steps={lay['gradient_accumulation_steps']} x {nproc} processes = "
                  f"generation_batch_size {lay['generation_batch_size']} = {prompts} x num_generations {samples} "
                  f"(steps_per_generation={lay['steps_per_generation']}: one generation per optimizer step)")
            ratios, rows = [], []
            for i in range(args.pairs):
                pair = {}
                for kind in ("trl", "evenrl"):
                    # pair i: seed i for both (prompt order, sampling), so rewards are compared over seeds
                    r = run_one(kind, workload, nproc, warmup, steps, threads, out, model, data, f"pair{i}",
                                args.verbose, seed=i, prof=prof)
                    pair[kind] = r
                    if i == 0:
                        print(f"   {kind} command: {shlex.join(r['cmd'])}")
                        if kind == "trl":
                            print(f"   TRL settings: {json.dumps(r['settings'])}; torch threads {r['threads']}")
                ratio = pair["evenrl"]["samples_per_s"] / pair["trl"]["samples_per_s"]
                ratios.append(ratio)
                rows.append(pair)
                t, e = pair["trl"], pair["evenrl"]
                print(f"   pair {i + 1} (seed {i}): TRL {t['samples_per_s']:6.1f} samples/s "
                      f"{t['tokens_per_s']:6.0f} tok/s "
                      f"{t['step_s']:.3f} s/step (generate+score {t['gen_s']:.3f}) reward {t['reward_end']:.3f} | "
                      f"evenrl {e['samples_per_s']:6.1f} samples/s {e['tokens_per_s']:6.0f} tok/s {e['step_s']:.3f} "
                      f"s/step (rollout+reward+advantage {e['gen_s']:.3f}) reward {e['reward_end']:.3f} | "
                      f"ratio {ratio:.2f}", flush=True)
            med = statistics.median(ratios)
            r_trl = statistics.median(p["trl"]["reward_end"] for p in rows)
            r_evenrl = statistics.median(p["evenrl"]["reward_end"] for p in rows)
            print(f"   median ratio evenrl/TRL samples/s: {med:.2f}  (pairs: {', '.join(f'{x:.2f}' for x in ratios)})")
            bars.append((f"{workload}\n{nproc} proc", med, *[statistics.median(p[k][m] for p in rows)
                                                          for k in ("trl", "evenrl") for m in ("gen_s", "step_s")]))
            table.append((workload, nproc, med, min(ratios), max(ratios),
                          statistics.median(p["trl"]["samples_per_s"] for p in rows),
                          statistics.median(p["evenrl"]["samples_per_s"] for p in rows),
                          r_trl, r_evenrl, rows[0]["trl"]["reward_first"], rows[0]["evenrl"]["reward_first"],
                          warmup + steps))
    print("\n| workload | procs | evenrl/TRL samples/s (median, min-max) | TRL samples/s | evenrl samples/s "
          "| reward after N steps TRL / evenrl (step-1 reward) | N |")
    print("|---|---|---|---|---|---|---|")
    for w, n, med, lo, hi, st, se, rt, re_, ft, fe, nsteps in table:
        print(f"| {w} | {n} | **{med:.2f}x** ({lo:.2f}-{hi:.2f}) | {st:.1f} | {se:.1f} | {rt:.3f} / {re_:.3f} "
              f"({ft:.3f} / {fe:.3f}) | {nsteps} |")
    print("(reward after N steps: mean reward of the last 3 steps, median over pairs)")
    if args.plot:
        plot_steps(bars, Path(args.plot))
        print(f"picture: {args.plot}")
    return 0


def plot_steps(bars: list[tuple], path: Path) -> None:
    """Median seconds per step of each framework, split into generate+score and the rest (the update), one panel per
    workload x processes: where each framework spends its step, and so what a further speed-up has to shrink."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(bars), figsize=(2.2 * len(bars) + 1, 3.6), squeeze=False)
    for ax, (label, ratio, trl_gen, trl_step, ev_gen, ev_step) in zip(axes[0], bars):
        gen, rest = [trl_gen, ev_gen], [trl_step - trl_gen, ev_step - ev_gen]
        ax.bar([0, 1], gen, color="#8fb3d9", label="generate + score")
        ax.bar([0, 1], rest, bottom=gen, color="#2c5f8a", label="update (rest of the step)")
        for x, total in enumerate([trl_step, ev_step]):
            ax.text(x, total, f"{total:.2f}" if total < 1 else f"{total:.1f}", ha="center", va="bottom", fontsize=8)
        ax.set_xticks([0, 1], ["TRL", "evenrl"])
        ax.set_title(f"{label}: {ratio:.2f}x", fontsize=9)
        ax.margins(y=0.15)
    axes[0][0].set_ylabel("seconds per step (median)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=2, fontsize=8, frameon=False)
    fig.suptitle("evenrl vs TRL GRPO on CPU: seconds per step (title: median per-pair samples/s ratio)", fontsize=10)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
