"""Every GPU measurement evenrl needs, in one command within a hard wall-clock budget: one JSON and one markdown table.

    python3 benchmarks/gpu_suite.py --budget-s 540 --out "$OUT"               # on the GPU machine (docs/performance.md)
    .venv/bin/python benchmarks/gpu_suite.py --tiny --device cpu --out /tmp/gs   # the rehearsal on CPU: every section

Sections run in order of value; each has an estimate of its seconds, and one that no longer fits in what is left of
the budget is skipped with that reason (the budget cuts from the end). Every child process runs under the deadline
(it is killed there: "cut"), so the whole run ends within the budget plus the final write. Outputs (--out; the
device tool brings back at most 8 files): gpu_suite.json, gpu_suite.md, gpu_suite.log (every child's output),
trace_bf16_update.json.gz and trace_bf16_update.txt.

Model and batch: benchmarks/gpu.py's (Qwen2.5-0.5B's dimensions, random weights, 494 M parameters; 16 prompts x 4
samples x 128 new tokens, token cap 4096, 2 mini-batches per step), built once and shared by every section but
trainer-throughput, which builds prime-rl's shapes itself.
Sections, in this order (the budget cuts from the end: the issue's four targets come first):
  ceiling .. sampler   one process, one model load (gpu_suite_kernels.py): the bf16 matmul ceiling; the step's
               phases in-process per precision scheme (gpu_suite_schemes.py: fp32, fp32+TF32, bf16 autocast, bf16
               parameters with fp32 master weights) with the update's TFLOP/s and MFU against the chip's bf16 peak;
               log-probs, loss and gradient of each scheme against float64; a torch.profiler trace of one bf16
               optimizer step of the update;
               the training forward's paths on a long-tail micro-batch (packed, segment-wise, right-padded, masked)
               and a Qwen3-30B-A3B-shaped MoE block by experts backend (gpu_suite_paths.py); fused vs foreach AdamW;
               the sampler alone (lean vs static x fp32 vs bf16: tokens/s and the share of the time the device is
               busy, the rest being Python and launches)
  trainer-throughput   the update alone at prime-rl's trainer-benchmark shapes (benchmarks/trainer_throughput.py:
               Qwen3-0.6B full and Qwen3-4B LoRA at 16 K tokens per sequence; tokens/s, MFU by prime-rl's formula,
               peak memory), one process per arm
  vs-trl       evenrl vs TRL GRPO in bf16: grpo_vs_trl.py's alternating pairs (>= 2 pairs if they fit)
  step-bf16-autocast, step-fp32   `evenrl train` (gpu.py's runs): step, rollout / log-prob / update seconds and
               peak GiB per phase, `evenrl plan` beside
  vllm-moe     a weight push into a vLLM engine serving a tiny Qwen3-MoE against a freshly loaded one: tensor by
               tensor and by log-probs (benchmarks/vllm_moe_reload.py); skipped where vLLM is not installed
  compile      the bf16 update with the packed training forward under torch.compile (compile time apart)
  step-fsdp-bf16, step-fp32-tf32  `evenrl train` with FSDP2 bf16, and fp32 with TF32 (cuBLAS override variable)
  trainer-throughput-64k   the same two shapes at 64 K tokens per sequence, each where it fits
Tensor parallelism has no row: it is not built yet (issue 41), so its overhead at TP = 1 cannot be measured.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT / "src"), str(HERE)]

import gpu  # noqa: E402  (benchmarks/gpu.py: model, data, evenrl train runs, plans)

SCHEMA = "evenrl.gpu_suite/1"
# name: (group, estimated seconds on one H100, on the 2-core CPU with --tiny). Order = value: the budget cuts
# from the end. GPU estimates from the 2026-11-23 H100 runs (process start + load ~20 s, steps 4-7 s).
SECTIONS = {
    "ceiling": ("kernels", 3, 2),
    "schemes": ("kernels", 70, 8),
    "precision": ("kernels", 25, 3),
    "trace": ("kernels", 20, 3),  # one optimizer step (55 s over its cap when it traced the whole RL step)
    "attention": ("kernels", 20, 6),
    "moe": ("kernels", 20, 4),
    "adamw": ("kernels", 5, 1),
    # last of its process: a CUDA graph capture gone wrong can break the context. --tiny: 43 s at load ~16 on the
    # 2-core machine (2026-11-28; it overran the 22 s cap of an estimate of 8)
    "sampler": ("kernels", 70, 25),
    "trainer-throughput": ("throughput", 90, 40),  # its arms' estimates (THROUGHPUT_ARMS); no shared model
    "vs-trl": ("trl", 170, 70),
    "step-bf16-autocast": ("train", 65, 25),
    "step-fp32": ("train", 60, 25),
    # a pushed MoE against a freshly loaded vLLM engine (vllm_moe_reload.py); where vLLM is installed. Not yet run
    # on a GPU: 2 engine starts guessed at ~40 s each; --tiny (CPU): ~90 s at load ~10 on the 2-core machine
    "vllm-moe": ("vllm", 90, 120),
    "compile": ("kernels", 140, 40),  # a second kernels process (load ~20 s)
    "step-fsdp-bf16": ("train", 65, 25),
    "step-fp32-tf32": ("train", 60, 25),
    "trainer-throughput-64k": ("throughput", 95, 20),  # its first arm's: each arm runs where it fits
}
KERNELS_LOAD = (30, 10)  # the kernels process's start and model load
TRAIN_ARMS = {  # evenrl train settings (gpu.ARMS) and extra environment
    "step-fp32": (gpu.ARMS["replicated-fp32"], {}),
    "step-bf16-autocast": (gpu.ARMS["replicated-bf16"], {}),
    "step-fsdp-bf16": (gpu.ARMS["fsdp-bf16"], {}),
    # TF32 for every fp32 matmul of the run, without a config field: the cuBLAS override variable torch reads
    "step-fp32-tf32": (gpu.ARMS["replicated-fp32"], {"TORCH_ALLOW_TF32_CUBLAS_OVERRIDE": "1"}),
}
# The trainer-throughput sections' arms, prime-rl's trainer-benchmark shapes (docs/performance.md), each one process
# of benchmarks/trainer_throughput.py (1 warm-up + 2 timed steps): name, its arguments, estimated seconds on one
# H100 (not yet run there: prime-rl's published step time x 2, x 3 steps, + ~15 s of start and model init). The
# 64 K arms are a section of their own at the end, where the budget cuts first. --tiny runs the same arms on the
# tiny shape, 16 K -> 64 tokens and 64 K -> 256: 34-41 s each at load ~12 on the 2-core CPU, ~8 s of it CPU time.
THROUGHPUT_ARMS = {
    "trainer-throughput": (("qwen3-0.6b-16k", ["--model", "qwen3-0.6b", "--seq-len", "16384"], 35),
                           ("qwen3-4b-lora-16k", ["--model", "qwen3-4b", "--lora-rank", "16", "--seq-len", "16384"],
                            55)),
    "trainer-throughput-64k": (("qwen3-0.6b-64k", ["--model", "qwen3-0.6b", "--seq-len", "65536"], 95),
                               ("qwen3-4b-lora-64k", ["--model", "qwen3-4b", "--lora-rank", "16", "--seq-len",
                                                      "65536"], 210)),
}
TINY_SEQ = {"16384": "64", "65536": "256"}
PEAK_BF16_TFLOPS = {"H100 PCIe": 756.0, "H100": 989.4, "H200": 989.4}  # dense, datasheets (SXM unless named)
RESERVE_S = 5.0  # kept back from every child's timeout for writing the results


class Budget:
    def __init__(self, seconds: float, tiny: bool):
        self.end = time.time() + seconds
        self.col = 2 if tiny else 1

    def left(self) -> float:
        return self.end - time.time()

    def estimate(self, name: str) -> float:
        return SECTIONS[name][self.col] if name in SECTIONS else KERNELS_LOAD[self.col - 1]

    def refuse(self, need: float) -> str | None:
        """Why a section of `need` estimated seconds is not started now, or None."""
        left = self.left() - RESERVE_S
        return None if left >= need else f"budget: {max(left, 0):.0f} s left, the section needs ~{need:.0f} s"

    def timeout(self) -> float:
        return max(self.left() - RESERVE_S, 1.0)


def section(name: str, status: str, reason: str | None = None, seconds: float | None = None,
            result: dict | None = None, estimate: float | None = None) -> dict:
    return {"name": name, "group": SECTIONS[name][0], "status": status, "reason": reason, "seconds": seconds,
            "estimate_s": estimate, "result": result}


# ------------------------------------------------------------------------------------------ sections

def run_train_arm(ctx, name: str) -> dict:
    settings, extra_env = TRAIN_ARMS[name]
    run_dir = ctx.work / "runs" / name
    s = {**settings, "log.run_dir": run_dir}
    rc, text, wall = gpu.train(ctx.log, name, ctx.cfg_path, s, ctx.budget.timeout(), ["--overwrite"], extra_env)
    rows = gpu.metrics(run_dir)
    if rc == 124:
        return {"status": "cut", "reason": f"killed at the deadline after {wall:.0f} s", "seconds": wall}
    if rc != 0 or not rows:
        return {"status": "failed", "reason": f"exit {rc}: {gpu.last_line(text)}", "seconds": wall}
    result = {"settings": {k: str(v) for k, v in settings.items()}, "env": extra_env, **gpu.summarize(rows)}
    if ctx.budget.left() > 20:  # `evenrl plan` is a few seconds of CPU
        result["plan"] = gpu.plan(ctx.log, ctx.cfg_path, settings, ctx.memory_gib)
    return {"status": "ran", "seconds": time.perf_counter() - ctx.t_section, "result": result}


def run_kernels(ctx, names: list[str]) -> dict[str, dict]:
    """The in-process sections in one child (gpu_suite_kernels.py), under the deadline."""
    result_file = ctx.work / "kernels.jsonl"
    result_file.write_text("")
    spec = {"model": str(ctx.model), "data": str(ctx.data), "device": ctx.device, "out": str(ctx.out),
            "work": str(ctx.work), "result_file": str(result_file), "sections": names,
            "deadline": ctx.budget.end - RESERVE_S, "estimates": {n: ctx.budget.estimate(n) for n in names},
            "prompts": ctx.args.prompts, "samples": ctx.args.samples, "new_tokens": ctx.args.new_tokens,
            "token_cap": ctx.args.token_cap, "reps": 1 if ctx.args.tiny else 2,
            "peak_bf16_tflops": ctx.info.get("peak_bf16_tflops")}
    spec_path = ctx.work / "kernels_spec.json"
    spec_path.write_text(json.dumps(spec))
    rc, text, wall = ctx.log.run("kernels " + ",".join(names), [sys.executable, str(HERE / "gpu_suite_kernels.py"),
                                                                str(spec_path)], ctx.budget.timeout())
    lines = [json.loads(x) for x in result_file.read_text().splitlines() if x.strip()]
    got = {x["name"]: x for x in lines}
    out, running = {}, None
    for n in names:
        x = got.get(n)
        if x is None:
            if running is None:
                running = n
                why = (f"killed at the deadline after {wall:.0f} s" if rc == 124 else
                       f"the kernels process exited {rc} here: {gpu.last_line(text)}")
                out[n] = {"status": "cut" if rc == 124 else "failed", "reason": why}
            else:
                out[n] = {"status": "skipped", "reason": f"budget: not reached (the kernels process stopped in "
                                                         f"{running})"}
        elif "skipped" in x:
            out[n] = {"status": "skipped", "reason": x["skipped"]}
        elif "error" in x:
            out[n] = {"status": "failed", "reason": x["error"], "seconds": x.get("seconds")}
        else:
            out[n] = {"status": "ran", "seconds": x["seconds"], "result": x["result"]}
    if "load" in got and names:
        first = next(n for n in names if n in out)
        out[first].setdefault("result", None)
        out[first]["load_s"] = got["load"]["seconds"]
    return out


def run_throughput(ctx, section_name: str) -> dict:
    """A trainer-throughput section: each of its arms that fits, in its own process (a fresh device: the 4B arms
    hold up to ~45 GiB), capped at 3x its estimate + 30 s so one slow arm leaves the next its time."""
    arms = {}
    for name, argv, est in THROUGHPUT_ARMS[section_name]:
        if ctx.args.tiny:
            argv, est = ["--tiny", *(TINY_SEQ.get(a, a) for a in argv[2:])], 20
        why = ctx.budget.refuse(est)
        if why:
            arms[name] = {"status": "skipped", "reason": why}
            continue
        out = ctx.work / f"throughput-{name}.json"
        cmd = [sys.executable, str(HERE / "trainer_throughput.py"), *argv, "--device", ctx.device, "--steps", "2",
               "--json", str(out)]
        rc, text, wall = ctx.log.run(f"{section_name} {name}", cmd, min(ctx.budget.timeout(), 3 * est + 30))
        if rc == 0 and out.exists():
            arms[name] = {"status": "ran", "seconds": wall, "result": json.loads(out.read_text())}
        else:
            arms[name] = {"status": "cut" if rc == 124 else "failed", "seconds": wall,
                          "reason": f"killed after {wall:.0f} s" if rc == 124 else f"exit {rc}: {gpu.last_line(text)}"}
    ran = [a for a in arms.values() if a["status"] == "ran"]
    first = next(iter(arms.values()))
    return {"status": "ran" if ran else first["status"], "reason": None if ran else first["reason"],
            "result": {"arms": arms} if ran else None}


def run_vllm_moe(ctx) -> dict:
    """vllm_moe_reload.py on a tiny Qwen3-MoE: its parameters after evenrl's push of changed weights against an
    engine that loaded them, and both engines' log-probs against the trainer's forward."""
    if importlib.util.find_spec("vllm") is None:
        return {"status": "skipped", "reason": "vLLM is not installed here"}
    out = ctx.work / "vllm_moe.json"
    cmd = [sys.executable, str(HERE / "vllm_moe_reload.py"), "--archs", "qwen3_moe", "--device", ctx.device,
           "--json", str(out)]
    rc, text, wall = ctx.log.run("vllm-moe", cmd, ctx.budget.timeout())
    if rc != 0 or not out.exists():
        return {"status": "cut" if rc == 124 else "failed", "seconds": wall,
                "reason": f"killed after {wall:.0f} s" if rc == 124 else f"exit {rc}: {gpu.last_line(text)}"}
    return {"status": "ran", "seconds": wall, "result": json.loads(out.read_text())["qwen3_moe"]}


def run_trl(ctx) -> dict:
    try:
        return _run_trl(ctx)
    finally:  # each run's own output, into the suite's log (the run directories go with the work dir)
        with ctx.log.path.open("a") as log:
            for run in sorted((ctx.work / "trl").glob("*-pair*")):
                for name in ("stdout.txt", "stderr.txt"):
                    if (run / name).exists():
                        log.write(f"==== vs-trl {run.name} {name}\n{(run / name).read_text()[-20000:]}\n")


def _run_trl(ctx) -> dict:
    import grpo_vs_trl as gvt

    if importlib.util.find_spec("trl") is None:  # a broken install shows in the first run's stderr instead
        return {"status": "failed", "reason": "TRL is not installed here; carry it: benchmarks/gpu_wheels.sh"}
    workload = "gpu-tiny" if ctx.args.tiny else "gpu"
    prompts = [json.loads(x)["prompt"] for x in ctx.data.read_text().splitlines() if x.strip()]
    prof = {"device": ctx.device, "dtype": "bfloat16", "decoder": "auto",
            "prompt_tokens": sum(map(len, prompts)) / len(prompts), "max_prompt_tokens": 64}
    pairs, need = [], ctx.budget.estimate("vs-trl") / 2
    for i in range(ctx.args.pairs):
        if i >= 2 and ctx.budget.refuse(need):
            break
        pair = {}
        for kind in ("trl", "evenrl"):
            try:
                threads = int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count() or 1)
                pair[kind] = gvt.run_one(kind, workload, 1, 1, ctx.args.trl_steps, threads,
                                         ctx.work / "trl", ctx.model, ctx.data, f"pair{i}", False, seed=i, prof=prof,
                                         timeout=ctx.budget.timeout())
            except subprocess.TimeoutExpired:
                return _trl_result(pairs, "cut", f"{kind} run of pair {i + 1} killed at the deadline")
            except SystemExit as e:  # run_one's one-line refusal or a failed run with its stderr tail
                return _trl_result(pairs, "failed", f"{kind}: {gpu.last_line(str(e))}")
            pair[kind].pop("cmd", None)
        pair["ratio"] = pair["evenrl"]["samples_per_s"] / pair["trl"]["samples_per_s"]
        pairs.append(pair)
    return _trl_result(pairs, "ran", None if len(pairs) >= 2 else "budget: fewer than 2 pairs fit")


def _trl_result(pairs: list[dict], status: str, reason: str | None) -> dict:
    if not pairs:
        return {"status": status, "reason": reason}
    ratios = [p["ratio"] for p in pairs]
    med = lambda k, m: statistics.median(p[k][m] for p in pairs)  # noqa: E731
    return {"status": status if status == "ran" else "cut", "reason": reason,
            "result": {"dtype": "bfloat16", "pairs": pairs, "ratios": ratios, "median_ratio": statistics.median(ratios),
                       "trl_samples_per_s": med("trl", "samples_per_s"),
                       "evenrl_samples_per_s": med("evenrl", "samples_per_s")}}


# ------------------------------------------------------------------------------------------ device, model

def device_info(device: str) -> dict:
    info = gpu.device_info()
    info["device"] = device
    if device == "cuda":
        try:
            info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                            capture_output=True, text=True, timeout=20).stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            info["driver"] = None
        name = info.get("gpu", "")
        info["peak_bf16_tflops"] = next((v for k, v in PEAK_BF16_TFLOPS.items() if all(w in name for w in k.split())),
                                        None)
    return info


def build(ctx) -> None:
    import torch

    t0 = time.perf_counter()
    ctx.model = gpu.make_model(ctx.work / "model", gpu.SHAPES[ctx.shape_name])
    ctx.data = ctx.work / "prompts.jsonl"
    gpu.write_data(ctx.data)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the children need the memory the random init held
    ctx.cfg_path = ctx.work / "bench.yaml"
    ns = SimpleNamespace(prompts=ctx.args.prompts, samples=ctx.args.samples, new_tokens=ctx.args.new_tokens,
                         steps=ctx.args.steps, token_cap=ctx.args.token_cap)
    ctx.cfg_path.write_text(json.dumps(gpu.base_config(ns, ctx.model, ctx.data)))
    ctx.results["model"] = {"shape_name": ctx.shape_name, "shape": gpu.SHAPES[ctx.shape_name],
                            "path": str(ctx.model), "build_s": time.perf_counter() - t0}


# ------------------------------------------------------------------------------------------ main

def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-s", type=float, default=540.0, help="hard wall-clock budget of the whole run")
    ap.add_argument("--out", default=None, help="output folder (default $OUT, else runs/gpu_suite)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--tiny", action="store_true", help="gpu.py's tiny shape and batch: the CPU rehearsal")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list, from {','.join(SECTIONS)}; the rest "
                                                                    "are written as skipped (not asked)")
    ap.add_argument("--steps", type=int, default=None, help="evenrl train steps per arm (default 3; --tiny 2)")
    ap.add_argument("--pairs", type=int, default=2, help="evenrl vs TRL pairs (more if they fit: 3)")
    ap.add_argument("--trl-steps", type=int, default=None, help="timed steps per vs-trl run after 1 warm-up step "
                                                                 "(default 2; --tiny 1)")
    args = ap.parse_args(argv)
    asked = [s for s in args.sections.split(",") if s]
    unknown = [s for s in asked if s not in SECTIONS]
    if unknown:
        ap.error(f"--sections: unknown {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    if args.budget_s <= 0:
        ap.error(f"--budget-s: {args.budget_s} is not a number of seconds > 0")
    args.asked = set(asked)
    args.steps = args.steps or (2 if args.tiny else 3)
    args.trl_steps = args.trl_steps or (1 if args.tiny else 2)
    args.prompts, args.samples, args.new_tokens = (4, 4, 16) if args.tiny else (16, 4, 128)
    args.token_cap = 4096
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    budget = Budget(args.budget_s, args.tiny)
    t_all = time.perf_counter()
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # every child too (evenrl train picks CUDA when it sees one)
    if args.tiny:  # the tiny model gains nothing from threads, and on a shared CPU OpenMP's waits cost seconds
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(HERE), os.environ.get("PYTHONPATH", "")])
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_suite.py: --device cuda but torch sees no CUDA device; the rehearsal is --tiny --device cpu")
        return 2
    out = Path(args.out or os.environ.get("OUT") or ROOT / "runs" / "gpu_suite")
    out.mkdir(parents=True, exist_ok=True)
    ctx = SimpleNamespace(args=args, budget=budget, out=out, device=args.device,
                          shape_name="tiny" if args.tiny else "qwen2.5-0.5b",
                          work=Path(tempfile.mkdtemp(prefix="evenrl-gpu-suite-")), log=gpu.Log(out / "gpu_suite.log"))
    ctx.info = device_info(args.device)
    ctx.memory_gib = ctx.info.get("gpu_memory_gib", 80.0)
    ctx.results = results = {
        "schema": SCHEMA, "argv": sys.argv[1:] if argv is None else list(argv), "budget_s": args.budget_s,
        "tiny": args.tiny, "device": ctx.info, "model": None,
        "workload": {"prompts": args.prompts, "samples": args.samples, "new_tokens": args.new_tokens,
                     "token_cap": args.token_cap, "minibatches_per_step": 2, "train_steps": args.steps},
        "sections": [], "wall_s": None}
    save = lambda: (out / "gpu_suite.json").write_text(json.dumps(results, indent=1, default=str))  # noqa: E731
    print(f"[gpu_suite] {ctx.info}; budget {args.budget_s:.0f} s; work dir {ctx.work}", flush=True)

    names = list(SECTIONS)
    i = 0
    while i < len(names):
        name = names[i]
        group = SECTIONS[name][0]
        if name not in args.asked:
            results["sections"].append(section(name, "skipped", "not asked (--sections)"))
            i += 1
            continue
        est = budget.estimate(name) + (budget.estimate("load") if group == "kernels" else 0)
        needs_model = results["model"] is None and group != "throughput"
        why = budget.refuse(est + (5 if args.tiny else 30) if needs_model else est)
        if why:
            results["sections"].append(section(name, "skipped", why, estimate=budget.estimate(name)))
            i += 1
            continue
        if needs_model:
            build(ctx)
            print(f"[gpu_suite] model and data in {results['model']['build_s']:.0f} s", flush=True)
        ctx.t_section = time.perf_counter()
        if group == "kernels":  # the rest of the group, in one process
            rest = list(itertools.takewhile(lambda n: SECTIONS[n][0] == "kernels", names[i:]))
            got = run_kernels(ctx, [n for n in rest if n in args.asked])
            for n in rest:
                r = got.get(n) or {"status": "skipped", "reason": "not asked (--sections)"}
                results["sections"].append(section(n, r["status"], r.get("reason"), r.get("seconds"),
                                                   r.get("result"), budget.estimate(n)))
                if "load_s" in r:
                    results["sections"][-1]["load_s"] = r["load_s"]
            i += len(rest)
        else:
            r = {"train": lambda: run_train_arm(ctx, name), "trl": lambda: run_trl(ctx),
                 "throughput": lambda: run_throughput(ctx, name), "vllm": lambda: run_vllm_moe(ctx)}[group]()
            r.setdefault("seconds", time.perf_counter() - ctx.t_section)
            results["sections"].append(section(name, r["status"], r.get("reason"), r["seconds"], r.get("result"),
                                               budget.estimate(name)))
            i += 1
        last = results["sections"][-1]
        print(f"[gpu_suite] {last['name']}: {last['status']} {last['reason'] or ''} "
              f"({budget.left():.0f} s of the budget left)", flush=True)
        save()
    shutil.rmtree(ctx.work, ignore_errors=True)  # the model and the runs' directories: GBs on the GPU machine
    results["wall_s"] = time.perf_counter() - t_all
    save()
    from gpu_suite_table import markdown

    text = markdown(results)
    (out / "gpu_suite.md").write_text(text)
    print(text, flush=True)
    return 0 if all(s["status"] in ("ran", "skipped") for s in results["sections"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
