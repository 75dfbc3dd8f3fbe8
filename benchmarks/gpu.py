"""evenrl's CUDA paths on one GPU: short `evenrl train` runs of a Qwen2.5-0.5B-shaped model in five settings, each
beside `evenrl plan`'s memory estimate, a kill-and-resume check and a precision check. One script, one device call.

    python3 benchmarks/gpu.py                 # on a CUDA machine: ~8.5 min on one H100 (docs/performance.md)
    .venv/bin/python benchmarks/gpu.py --tiny # a tiny shape, on CPU too: what this script does, in 1-3 min

Needs evenrl's dependencies only (it puts src/ and benchmarks/ on the workers' PYTHONPATH, so evenrl need not be
installed); the CPU-offload arm is refused on a machine without an accelerator, and says so in the table.

Model: Qwen2 config with Qwen2.5-0.5B's dimensions (hidden 896, 24 layers, 14 heads, 2 KV heads, MLP 4864,
vocabulary 151,936, tied embeddings: 494 M parameters), random weights (seed 0), written here; nothing is
downloaded. Its tokenizer is the demo's byte-level one (evenrl.models.loading.make_tiny_model) with its vocabulary
filled up to the model's size with 2- and 3-character tokens, so every id the random model samples decodes to
text and the reward (share of digit characters in the completion) differs between samples: GRPO advantages are
not all 0, and every sample is trained on.
Data: prompts "a+b+c+...=" of 40-64 characters (one token each), the sum as the answer.

Arms (the rest of the config is common: 16 prompts x 4 samples, 128 new tokens, 2 mini-batches per step so that
the old-log-prob pass runs, token cap 4096 per micro-batch, AdamW, lr 1e-5; one process, `evenrl train`):
  replicated fp32 | replicated bf16 (autocast) | fsdp bf16 (FSDP2 on a 1-rank NCCL group) |
  fsdp bf16 + parallel.cpu_offload=full | fsdp bf16 + model.gradient_checkpointing
Measured per arm from its metrics.jsonl: step time (median over the steps after the first), samples/s (samples per
step / that median), seconds of the rollout, log-prob and update phases (medians), and per phase the peak of
torch.cuda.max_memory_allocated (evenrl's memory/<phase>_peak_gib metrics; the largest over the timed steps).
Planned: `evenrl plan CONFIG --device cuda --device-memory-gib 80 --json` for the same config (phases_gib).
The plan includes 1 GiB of per-process overhead (CUDA context, allocator slack) that max_memory_allocated does not
count, so "planned" should exceed "measured" by about that much when the estimate is right.

Resume: the fsdp bf16 arm runs with checkpoint.every_steps=2 (run A); run B is the same config killed at the start
of step 3 (EVENRL_TEST_CRASH_AT_STEP, exit 17) and continued with --resume. B's steps 1-2 against A's say how far
two identical runs drift on this GPU (its kernels are not bitwise deterministic); B's steps 3-4 and final weights
against A's say whether the resume adds anything to that.
Precision: one fixed batch (8 prompts with 128 random response tokens each, fixed random advantages) through
evenrl's training forward (evenrl.models.forward.response_logits, evenrl.core.losses.token_logprobs) and the
surrogate loss -token_mean(A * log p), backward: float64 (the reference), fp32 and bf16, replicated and FSDP2, and
bf16 FSDP2 with CPU offload (CUDA only).
Reported against float64: mean |delta log p|, relative error of the loss and of the whole gradient.

Results: a table on stdout; everything in OUT/gpu_results.json and every run's output in OUT/gpu_runs.log
(OUT: $OUT, else --out).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

SHAPES = {
    # Qwen2.5-0.5B's config.json, dimensions only
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
                         max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=2048, tie_word_embeddings=True, max_position_embeddings=512,
                 rope_theta=10000.0, rms_norm_eps=1e-6),
}

ARMS = {
    "replicated-fp32": {"model.dtype": "float32", "parallel.sharding": "replicated"},
    "replicated-bf16": {"model.dtype": "bfloat16", "parallel.sharding": "replicated"},
    "fsdp-bf16": {"model.dtype": "bfloat16", "parallel.sharding": "fsdp"},
    "fsdp-bf16-offload": {"model.dtype": "bfloat16", "parallel.sharding": "fsdp", "parallel.cpu_offload": "full"},
    "fsdp-bf16-actckpt": {"model.dtype": "bfloat16", "parallel.sharding": "fsdp", "model.gradient_checkpointing": True},
    # the sampler's static decoder: each decoding step replayed from one CUDA graph (models.decode_graph)
    "replicated-fp32-static": {"model.dtype": "float32", "parallel.sharding": "replicated",
                               "rollout.decoder": "static"},
    "replicated-bf16-static": {"model.dtype": "bfloat16", "parallel.sharding": "replicated",
                               "rollout.decoder": "static"},
    "fsdp-bf16-static": {"model.dtype": "bfloat16", "parallel.sharding": "fsdp", "rollout.decoder": "static"},
}
RESUME_ARM = "fsdp-bf16"
PHASES = [("rollout", "rollout"), ("logprobs", "log-probs"), ("update", "update")]  # evenrl timer -> plan phase
GIB = 2**30


def digit_fraction(completion: str, sample: dict) -> float:
    """The reward (evenrl calls it as gpu:digit_fraction): share of the completion's characters that are digits."""
    return sum(c.isdigit() for c in completion) / max(len(completion), 1)


# ------------------------------------------------------------------------------------------ model and data

def make_model(out: Path, shape: dict) -> Path:
    """A random Qwen2 model of `shape` with the demo's tokenizer, its vocabulary filled up to the model's."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    from evenrl.testing import DEFAULT_VOCAB, _bytes_to_unicode, make_tiny_model

    make_tiny_model(str(out))  # tokenizer files (and a tiny model, replaced below)
    path = out / "tokenizer.json"
    tok = json.loads(path.read_text())
    vocab = tok["model"]["vocab"]
    # BPE without merges encodes one token per byte, whatever else the vocabulary holds; the longer tokens only
    # decode, which is all a sampled id needs
    byte_char = _bytes_to_unicode()
    alphabet = [byte_char[b] for c in dict.fromkeys(DEFAULT_VOCAB) for b in c.encode()]
    for k in (2, 3):
        for combo in itertools.product(alphabet, repeat=k):
            if len(vocab) >= shape["vocab_size"]:
                break
            vocab.setdefault("".join(combo), len(vocab))
    path.write_text(json.dumps(tok))
    tokenizer = AutoTokenizer.from_pretrained(out, local_files_only=True)
    config = Qwen2Config(**shape, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=tokenizer.bos_token_id)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(device):  # random init of 494 M parameters: seconds on a GPU, a minute on a CPU
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    return out


def write_data(path: Path, n: int = 256, seed: int = 0) -> None:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        terms, text = [], ""
        while len(text) < rng.randint(40, 62):
            terms.append(rng.randint(1, 999))
            text = "+".join(map(str, terms)) + "="
        rows.append({"prompt": text, "answer": str(sum(terms))})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def base_config(args, model: Path, data: Path) -> dict:
    return {
        "model": {"path": str(model)},
        "data": {"path": str(data), "prompts_per_step": args.prompts, "max_prompt_tokens": 64},
        "rollout": {"samples_per_prompt": args.samples, "max_new_tokens": args.new_tokens, "temperature": 1.0},
        "rewards": {"functions": [{"name": "gpu:digit_fraction"}], "isolate": False},
        "algo": {"advantage": "grpo", "minibatches_per_step": 2},
        "train": {"steps": args.steps, "lr": 1e-5, "token_cap_per_micro_batch": args.token_cap, "seed": 0},
        "log": {"samples_every_steps": 0, "tensorboard": False, "progress": False},
    }


def overrides(settings: dict) -> list[str]:
    return [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in settings.items()]


# ------------------------------------------------------------------------------------------ runs

def env() -> dict:
    path = os.pathsep.join([str(ROOT / "src"), str(HERE), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1", "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}


class Log:
    def __init__(self, path: Path):
        self.path = path
        path.write_text("")

    def run(self, title: str, cmd: list[str], timeout: float, extra_env: dict | None = None) -> tuple[int, str, float]:
        t0 = time.perf_counter()
        try:
            p = subprocess.run(cmd, cwd=ROOT, env={**env(), **(extra_env or {})}, capture_output=True, text=True,
                               timeout=timeout)
            rc, text = p.returncode, p.stdout + p.stderr
        except subprocess.TimeoutExpired as e:
            rc = 124
            text = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
            text += f"\n[gpu.py] killed after {timeout:.0f} s"
        wall = time.perf_counter() - t0
        with self.path.open("a") as f:
            f.write(f"==== {title} (exit {rc}, {wall:.1f} s)\n$ {' '.join(cmd)}\n{text}\n")
        return rc, text, wall


def one_line(e: BaseException) -> str:
    """An exception as one line of a result: its type and its message's first line."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:300] if text else ''}"


def last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    for line in reversed(lines):  # evenrl's own one-line error, when there is one
        if line.startswith("evenrl"):
            return line[:300]
    return (lines[-1] if lines else "no output")[:300]


def train(log: Log, title: str, cfg_path: Path, settings: dict, timeout: float, extra: list[str] = (),
          extra_env: dict | None = None) -> tuple[int, str, float]:
    cmd = [sys.executable, "-m", "evenrl.cli", "train", str(cfg_path), *overrides(settings), "--nproc-per-node",
           "1", *extra]
    return log.run(title, cmd, timeout, extra_env)


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    return [r for r in rows if r.get("step", 0) >= 1 and "time/step" in r]


def summarize(rows: list[dict]) -> dict:
    timed = rows[1:] or rows  # the first step pays for CUDA kernels' first launches, allocator growth, autotuning
    med = lambda key: statistics.median(r.get(key, 0.0) for r in timed)  # noqa: E731
    step = med("time/step")
    out = {"steps": len(rows), "timed_steps": len(timed), "step_s": step, "samples": rows[0]["samples"],
           "samples_per_s": rows[0]["samples"] / step,
           "tokens_per_s_step1": rows[0].get("perf/tokens_per_s"),
           "phase_s": {name: med(f"time/{name}") for name, _ in PHASES},
           "peak_gib": {name: max((r.get(f"memory/{name}_peak_gib", float("nan")) for r in timed), default=None)
                        for name, _ in PHASES},
           "first_step": {k: rows[0].get(k) for k in ("policy/loss", "grad_norm", "reward/mean",
                                                       "rollout/logprob_mismatch", "response/length_mean")}}
    if not any(f"memory/{n}_peak_gib" in rows[0] for n, _ in PHASES):
        out["peak_gib"] = None  # no CUDA: evenrl logs no memory metric
    return out


def plan(log: Log, cfg_path: Path, settings: dict, memory_gib: float) -> dict | None:
    cmd = [sys.executable, "-m", "evenrl.cli", "plan", str(cfg_path), *overrides(settings), "--device", "cuda",
           "--device-memory-gib", str(memory_gib), "--nproc-per-node", "1", "--json"]
    rc, text, _ = log.run("plan " + " ".join(overrides(settings)), cmd, 60)
    try:
        mem = json.loads(text[text.index("{"):text.rindex("}") + 1])["memory"]
    except (ValueError, KeyError, TypeError):
        return None
    return {"phases_gib": mem["phases_gib"], "total_gib": mem["total_gib"], "host_gib": mem["host_gib"],
            "overhead_gib": mem["breakdown_gib"]["overhead"], "params": mem["params"]}


def resume_check(log: Log, cfg_path: Path, settings: dict, run_a: Path, work: Path, timeout: float) -> dict:
    """Run B: A's config killed at the start of step 3, then --resume. Compared with A (see the module docstring)."""
    run_b = work / "runs" / "resume-B"
    s = {**settings, "log.run_dir": run_b, "checkpoint.every_steps": 2}
    rc1, text1, wall1 = train(log, "resume B: killed at step 3", cfg_path, s, timeout, ["--overwrite"],
                              {"EVENRL_TEST_CRASH_AT_STEP": "3"})
    out: dict = {"killed_exit": rc1}
    if rc1 != 17:
        out["error"] = f"the run to be killed exited {rc1}, not 17: {last_line(text1)}"
        return out
    rc2, text2, wall2 = train(log, "resume B: --resume", cfg_path, s, timeout, ["--resume"])
    out["resume_exit"] = rc2
    if rc2 != 0:
        out["error"] = f"--resume exited {rc2}: {last_line(text2)}"
        return out
    out["resumed_line"] = next((line for line in text2.splitlines() if "resumed from" in line), None)
    a, b = metrics(run_a), metrics(run_b)
    keys = ["reward/mean", "policy/loss", "grad_norm", "rollout/logprob_mismatch"]
    out["steps"] = {r["step"]: {k: [r.get(k), rb.get(k)] for k in keys} for r, rb in zip(a, b)}
    try:
        from safetensors.torch import load_file

        init = load_file(str(Path(json.loads(cfg_path.read_text())["model"]["path"]) / "model.safetensors"))
        fa, fb = load_file(str(run_a / "final" / "model.safetensors")), load_file(str(run_b / "final" / "model.safetensors"))
        diff = max(float((fa[k].float() - fb[k].float()).abs().max()) for k in fa)
        moved = sum(float((fa[k].double() - init[k].double()).pow(2).sum()) for k in fa) ** 0.5
        dab = sum(float((fa[k].double() - fb[k].double()).pow(2).sum()) for k in fa) ** 0.5
        out["final_max_abs_diff"] = diff
        out["final_diff_over_update"] = dab / max(moved, 1e-30)  # |A - B| / |A - initial|
    except Exception as e:  # noqa: BLE001 - a comparison that cannot run is reported, not fatal
        out["weights_error"] = f"{type(e).__name__}: {e}"[:300]
    return out


# ------------------------------------------------------------------------------------------ precision

def precision_check(model_dir: str, data: str, rows: int, new_tokens: int) -> dict:
    """See the module docstring. Runs in its own process (an FSDP2 variant joins a 1-rank process group)."""
    import torch
    from torch.distributed.tensor import DTensor
    from transformers import AutoTokenizer

    from evenrl.config import RunConfig
    from evenrl.core.batch import Batch, Ragged
    from evenrl.core.losses import token_logprobs
    from evenrl.distributed import collectives as dist
    from evenrl.models.forward import response_logits
    from evenrl.models.loading import load_policy
    from evenrl.train.parallelize import parallelize

    info = dist.init()
    dev = info.device
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    g = torch.Generator().manual_seed(1)
    prompts = [json.loads(line)["prompt"] for line in Path(data).read_text().splitlines()[:rows]]
    ordinary = len(tok) - 1  # any id past the specials; the vocabulary is filled (make_model)
    tokens = [torch.tensor(tok.encode(p) + torch.randint(4, ordinary, (new_tokens,), generator=g).tolist())
              for p in prompts]
    batch = Batch({"tokens": Ragged.of(tokens, torch.long),
                   "response_len": torch.full((rows,), new_tokens, dtype=torch.long)})
    adv = torch.randn(rows, generator=g, dtype=torch.float64)

    def one(dtype: str, sharding: str, double: bool = False, offload: str = "none"):
        model, _ = load_policy(model_dir, dtype="float32", device=dev)
        if double:
            model.double()
        else:
            parallelize(model, info, RunConfig.model_validate({"model": {"dtype": dtype}, "parallel": {
                "sharding": sharding, "cpu_offload": offload}}))
        model.train()
        logits, targets, mask = response_logits(model, batch, tok.pad_token_id)
        logp = token_logprobs(logits, targets) if not double else \
            torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
        a = adv.to(dev, logp.dtype)[:, None]
        loss = -(a * logp * mask).sum() / mask.sum()
        loss.backward()
        grads = []
        for _, p in sorted(model.named_parameters()):
            gr = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            grads.append(gr.reshape(-1).double().to(dev))  # offloaded gradients are on the host
        out = (logp.detach().double()[mask], float(loss.detach()), torch.cat(grads))
        del model, logits, logp
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        return out

    ref_lp, ref_loss, ref_g = one("float32", "replicated", double=True)
    result = {"rows": rows, "response_tokens": new_tokens, "reference": "float64, replicated",
              "ref_mean_logp": float(ref_lp.mean()), "ref_loss": ref_loss, "variants": {}}
    variants = [("fp32 replicated", "float32", "replicated", "none"),
                ("bf16 replicated (autocast)", "bfloat16", "replicated", "none"),
                ("fp32 fsdp", "float32", "fsdp", "none"), ("bf16 fsdp", "bfloat16", "fsdp", "none")]
    if dev.type == "cuda":  # offload is refused on a CPU-only machine
        variants.append(("bf16 fsdp cpu_offload=full", "bfloat16", "fsdp", "full"))
    for name, dtype, sharding, offload in variants:
        try:
            lp, loss, gr = one(dtype, sharding, offload=offload)
            result["variants"][name] = {
                "mean_abs_dlogp": float((lp - ref_lp).abs().mean()), "max_abs_dlogp": float((lp - ref_lp).abs().max()),
                "loss_rel_err": abs(loss - ref_loss) / max(abs(ref_loss), 1e-30),
                "grad_rel_err": float((gr - ref_g).norm() / ref_g.norm())}
        except Exception as e:  # noqa: BLE001 - reported in the table
            result["variants"][name] = {"error": f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"}
    dist.shutdown()
    return result


# ------------------------------------------------------------------------------------------ main

def device_info() -> dict:
    import torch
    import transformers

    info = {"torch": torch.__version__, "transformers": transformers.__version__, "cuda": torch.cuda.is_available()}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, gpu_memory_gib=round(p.total_memory / GIB, 1), cuda_runtime=torch.version.cuda,
                    nccl=".".join(map(str, torch.cuda.nccl.version())))
    return info


def fmt(x, spec=".2f", none="-") -> str:
    return none if x is None or x != x else format(x, spec)


def table(results: dict) -> str:
    lines = ["", f"evenrl on {results['device'].get('gpu', 'CPU')} (torch {results['device']['torch']}, "
             f"transformers {results['device']['transformers']}); model {results['shape_name']} "
             f"({results.get('params', 0) / 1e6:.0f} M params); {results['workload']}",
             "peak GiB: torch.cuda.max_memory_allocated within the phase (largest over the timed steps) / "
             "evenrl plan's estimate for the phase (incl. its 1 GiB per-process overhead)",
             f"{'arm':<20} {'ran':<4} {'step s':>7} {'samples/s':>9} {'rollout s':>9} {'logp s':>7} {'update s':>8}"
             f"  {'rollout GiB':>12} {'log-probs GiB':>13} {'update GiB':>12}"]
    for name, r in results["arms"].items():
        if not r.get("ran"):
            lines.append(f"{name:<20} {'no':<4} {r.get('error', '')[:150]}")
            continue
        s, pl = r["summary"], (r.get("plan") or {}).get("phases_gib", {})
        mem = []
        for ph, plan_ph in PHASES:
            m = (s["peak_gib"] or {}).get(ph)
            mem.append(f"{fmt(m, '.1f')}/{fmt(pl.get(plan_ph), '.1f')}")
        lines.append(f"{name:<20} {'yes':<4} {s['step_s']:7.2f} {s['samples_per_s']:9.1f} "
                     f"{s['phase_s']['rollout']:9.2f} {s['phase_s']['logprobs']:7.2f} {s['phase_s']['update']:8.2f}  "
                     f"{mem[0]:>12} {mem[1]:>13} {mem[2]:>12}")
    firsts = {n: r["summary"]["first_step"] for n, r in results["arms"].items() if r.get("ran")}
    if firsts:
        lines.append("first step (each arm samples its own completions): "
                     + "; ".join(f"{n}: reward {fmt(f['reward/mean'], '.4f')}, grad_norm {fmt(f['grad_norm'], '.4f')}, "
                                 f"engine/trainer logp mismatch {fmt(f['rollout/logprob_mismatch'], '.2e')}"
                                 for n, f in firsts.items()))
    rs = results.get("resume")
    if rs:
        if "error" in rs:
            lines.append(f"resume ({RESUME_ARM}): FAILED: {rs['error']}")
        else:
            lines.append(f"resume ({RESUME_ARM}, killed at step 3 with exit {rs['killed_exit']}, {rs['resumed_line']}):")
            for step, vals in rs["steps"].items():
                lines.append(f"  step {step}: " + "; ".join(f"{k} A {fmt(a, '.6g')} B {fmt(b, '.6g')}"
                                                            for k, (a, b) in vals.items()))
            if "final_max_abs_diff" in rs:
                lines.append(f"  final weights: max |A - B| {rs['final_max_abs_diff']:.3g}; "
                             f"|A - B| / |A - initial| = {rs['final_diff_over_update']:.3g}")
            else:
                lines.append(f"  final weights not compared: {rs.get('weights_error')}")
    pc = results.get("precision")
    if pc:
        if "error" in pc:
            lines.append(f"precision check FAILED: {pc['error']}")
        else:
            lines.append(f"precision vs float64 ({pc['rows']} rows x {pc['response_tokens']} response tokens, "
                         f"mean log p {pc['ref_mean_logp']:.4f}, surrogate loss {pc['ref_loss']:.6g}):")
            for name, v in pc["variants"].items():
                lines.append(f"  {name:<28} " + (v["error"] if "error" in v else
                             f"mean |dlogp| {v['mean_abs_dlogp']:.2e}  max |dlogp| {v['max_abs_dlogp']:.2e}  "
                             f"loss rel err {v['loss_rel_err']:.2e}  grad rel err {v['grad_rel_err']:.2e}"))
    lines.append(f"whole script {results.get('wall_s', 0):.0f} s")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="tiny shape and batch (runs on CPU: for debugging this script)")
    ap.add_argument("--out", default=None, help="where results and logs go (default $OUT, else a temp dir)")
    ap.add_argument("--arms", default=",".join(a for a in ARMS if not a.endswith("-static")),
                    help=f"comma-separated, from {','.join(ARMS)} (default: all but the -static ones, which with "
                         "the rest would outlast one 600 s device call)")
    ap.add_argument("--steps", type=int, default=None, help="RL steps per arm (default 4; --tiny 3)")
    ap.add_argument("--prompts", type=int, default=None)
    ap.add_argument("--samples", type=int, default=None)
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--token-cap", type=int, default=4096)
    ap.add_argument("--no-resume", action="store_true")
    ap.add_argument("--no-precision", action="store_true")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per evenrl run (default 150; --tiny 120)")
    ap.add_argument("--device-memory-gib", type=float, default=80.0)
    ap.add_argument("--precision-worker", nargs=4, metavar=("MODEL", "DATA", "ROWS", "NEW"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.precision_worker:
        m, d, r, n = args.precision_worker
        print("PRECISION " + json.dumps(precision_check(m, d, int(r), int(n))), flush=True)
        return 0
    t_all = time.perf_counter()
    shape_name = "tiny" if args.tiny else "qwen2.5-0.5b"
    defaults = dict(steps=3, prompts=4, samples=4, new_tokens=16, timeout=120) if args.tiny else \
        dict(steps=4, prompts=16, samples=4, new_tokens=128, timeout=150)
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    arms = [a for a in args.arms.split(",") if a]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        ap.error(f"--arms: unknown {unknown}; choose from {list(ARMS)}")
    out = Path(args.out or os.environ.get("OUT") or tempfile.mkdtemp(prefix="evenrl-gpu-out-"))
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="evenrl-gpu-"))  # the model and checkpoints: GBs, never under OUT
    sys.path[:0] = [str(ROOT / "src")]
    log = Log(out / "gpu_runs.log")
    results: dict = {"device": device_info(), "shape_name": shape_name, "shape": SHAPES[shape_name],
                     "workload": f"{args.prompts} prompts x {args.samples} samples, {args.new_tokens} new tokens, "
                                 f"{args.steps} steps (first not timed), 2 mini-batches/step, token cap "
                                 f"{args.token_cap}", "arms": {}, "args": vars(args)}
    save = lambda: (out / "gpu_results.json").write_text(json.dumps(results, indent=1, default=str))  # noqa: E731
    print(f"[gpu.py] {results['device']}; work dir {work}", flush=True)

    t0 = time.perf_counter()
    model = make_model(work / "model", SHAPES[shape_name])
    data = work / "prompts.jsonl"
    write_data(data)
    from safetensors import safe_open
    with safe_open(str(model / "model.safetensors"), "pt") as f:
        results["params"] = sum(_numel(f.get_slice(k).get_shape()) for k in f.keys())  # tied: stored once
    results["model_s"] = time.perf_counter() - t0
    print(f"[gpu.py] model ({results['params'] / 1e6:.1f} M params) and data in {results['model_s']:.0f} s", flush=True)
    cfg_path = work / "bench.yaml"
    cfg_path.write_text(json.dumps(base_config(args, model, data)))  # JSON is YAML

    for name in arms:
        settings = {**ARMS[name], "log.run_dir": work / "runs" / name}
        if name == RESUME_ARM and not args.no_resume:
            settings["checkpoint.every_steps"] = 2  # run A of the resume check; saves happen outside the step timer
        rc, text, wall = train(log, name, cfg_path, settings, args.timeout, ["--overwrite"])
        r: dict = {"exit": rc, "wall_s": wall, "settings": {k: str(v) for k, v in settings.items()}}
        rows = metrics(work / "runs" / name)
        if rc == 0 and rows:
            r["ran"] = True
            r["summary"] = summarize(rows)
        else:
            r["ran"] = False
            r["error"] = f"exit {rc}: {last_line(text)}"
        r["plan"] = plan(log, cfg_path, {k: v for k, v in settings.items() if k != "log.run_dir"},
                         args.device_memory_gib)
        results["arms"][name] = r
        save()
        print(f"[gpu.py] {name}: exit {rc} in {wall:.0f} s" + (f"; {r['error']}" if not r["ran"] else
              f"; step {r['summary']['step_s']:.2f} s, peaks {r['summary']['peak_gib']}"), flush=True)

    if not args.no_resume and results["arms"].get(RESUME_ARM, {}).get("ran"):
        settings = {**ARMS[RESUME_ARM]}
        results["resume"] = resume_check(log, cfg_path, settings, work / "runs" / RESUME_ARM, work, args.timeout)
        save()
        print(f"[gpu.py] resume: {results['resume'].get('error', 'done')}", flush=True)

    if not args.no_precision:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--precision-worker", str(model), str(data), "8",
               str(min(args.new_tokens, 128))]
        rc, text, wall = log.run("precision", cmd, args.timeout)
        line = next((x for x in text.splitlines() if x.startswith("PRECISION ")), None)
        results["precision"] = json.loads(line[len("PRECISION "):]) if rc == 0 and line else \
            {"error": f"exit {rc}: {last_line(text)}"}
        results["precision_s"] = wall
        save()

    results["wall_s"] = time.perf_counter() - t_all
    save()
    print(table(results), flush=True)
    return 0 if all(r.get("ran") for r in results["arms"].values()) else 1


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
