"""benchmarks/gpu_suite.py's in-process sections: one process, one model load, every measurement that needs no
`evenrl train` of its own (gpu_suite.py's docstring lists them). Run by gpu_suite.py, not by hand:

    python3 benchmarks/gpu_suite_kernels.py SPEC.json      # SPEC: model, data, sections, deadline, result file

Each finished section appends one JSON line {"name", "seconds", "result" | "error" | "skipped"} to the result file,
so a run killed at the suite's deadline keeps what it finished. A section whose estimate no longer fits before the
deadline is written as skipped with the reason; one that runs past 1.5x its estimate + 10 s is stopped (SIGALRM).
"""

from __future__ import annotations

import copy
import gzip
import json
import shutil
import signal
import statistics
import sys
import time
from pathlib import Path

import torch

from evenrl.config import load_config
from evenrl.core.batch import Batch, Ragged
from evenrl.core.losses import token_logprobs
from evenrl.core.model_plan import record
from evenrl.distributed.mesh import Mesh
from evenrl.engines.base import Request
from evenrl.engines.hf import SamplingParams, generate
from evenrl.models import forward as forward_module
from evenrl.models.forward import response_logits, response_logprobs
from evenrl.models.loading import load_policy, set_autocast
from evenrl.train.parallelize import split_sequences
from evenrl.train.update import compute_logprobs, minibatch_denominators, minibatch_update
from gpu import one_line
from gpu_suite_paths import sec_attention, sec_moe
from gpu_suite_schemes import BF16_BOUNDS, SCHEMES, scheme_model, set_tf32

GIB = 2**30
# Profiled rollouts generate this many new tokens, not the step's: every decoding step is the same work, and a
# profile of 128 steps x 4 arms (its events walked in Python) took the sampler section over its cap on an H200
# (2026-11-27: 86 s; the trace section 55 s)
PROFILED_NEW_TOKENS = 16
SPANS = ("sampler", "update")  # the record_function ranges busy_share measures
TRACE = "trace_bf16_update"  # the trace section's files in --out: .json.gz (Perfetto) and .txt (the top ops)


class Ctx:
    """What every section shares: the device, the fp32 model (loaded once), the step's batch."""

    def __init__(self, spec: dict):
        self.spec = spec
        self.dev = torch.device(spec["device"])
        self.model, self.tok = load_policy(spec["model"], device=self.dev)
        split_sequences(self.model, load_config(None, []), Mesh())  # the packed training forward, as evenrl train's
        self.model.train()  # as a trainer holds it; the sampler and the log-prob pass switch to eval themselves
        self.pad = self.tok.pad_token_id
        rows = [json.loads(x) for x in Path(spec["data"]).read_text().splitlines() if x.strip()]
        self.prompts = [self.tok.encode(r["prompt"]) for r in rows[: spec["prompts"]]]
        self.samples, self.new = spec["samples"], spec["new_tokens"]
        self.params = sum(p.numel() for p in self.model.parameters())
        cfg = self.model.config
        self.embed = cfg.vocab_size * cfg.hidden_size

    def sync(self):
        if self.dev.type == "cuda":
            torch.cuda.synchronize()

    def reset_peak(self):  # memory: CUDA's allocator statistics only (None on CPU)
        self.sync()
        if self.dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()

    def peak(self):
        return torch.cuda.max_memory_allocated() / GIB if self.dev.type == "cuda" else None

    def free(self):
        if self.dev.type == "cuda":
            torch.cuda.empty_cache()

    def timed(self, fn):
        self.sync()
        t0 = time.perf_counter()
        out = fn()
        self.sync()
        return time.perf_counter() - t0, out

    def rollout(self, model, decoder="auto", new_tokens=None):
        params = SamplingParams(max_new_tokens=new_tokens or self.new, samples_per_prompt=self.samples, seed=0)
        return generate(model, [Request(p, i, 0) for i, p in enumerate(self.prompts)], params, eos_token_ids=set(),
                        pad_token_id=self.pad, decoder=decoder)

    def step_batch(self, completions=None, seed=0) -> Batch:
        """The step's rows: each prompt x samples with its completion (or random response tokens)."""
        g = torch.Generator().manual_seed(seed)
        tokens, resp = [], []
        for i, p in enumerate(self.prompts):
            for s in range(self.samples):
                r = completions[i][s].token_ids if completions else \
                    torch.randint(4, len(self.tok) - 1, (self.new,), generator=g).tolist()
                tokens.append(torch.tensor(p + r))
                resp.append(len(r))
        adv = torch.randn(len(tokens), generator=g)
        return Batch({"tokens": Ragged.of(tokens, torch.long), "response_len": torch.tensor(resp),
                      "advantages": adv})

    def micro_rows(self, rows: list[int], batch: Batch) -> list[list[int]]:
        """Rows in micro-batches of at most token_cap padded tokens (evenrl's cap, the longest row times rows)."""
        width = int(batch["tokens"].lengths.max())
        per = max(1, self.spec["token_cap"] // width)
        return [rows[i: i + per] for i in range(0, len(rows), per)]

    def update(self, model, optimizer, batch: Batch, minibatches: int = 2) -> None:
        """The step's update: `minibatches` mini-batches (gpu.py's minibatches_per_step: 2), one optimizer step
        each."""
        n = len(batch)
        for half in [list(range(i * n // minibatches, (i + 1) * n // minibatches)) for i in range(minibatches)]:
            minibatch_update(model, optimizer, None, batch, self.micro_rows(half, batch),
                             minibatch_denominators(batch["response_len"], half),
                             forward=lambda m, mb: response_logprobs(m, mb, self.pad),
                             loss_fn=lambda out, tg, mask, mb: (-mb["advantages"].to(out.device)[:, None]
                                                                * out[..., 0], {}),
                             stat_names=[], aggregation="token-mean", max_grad_norm=1.0, pad_token_id=self.pad)

    def update_flops(self, batch: Batch) -> float:
        """Matmul FLOPs of one update (forward + backward = 3 x forward): 2 per parameter per token in the layers
        (the embedding is a lookup), 2 x hidden x vocabulary per response token in the output layer (evenrl runs
        it on response positions only), and attention's two products, causal (about half the scores)."""
        cfg = self.model.config
        lens = batch["tokens"].lengths.double()
        body = 2 * (self.params - self.embed) * float(lens.sum())
        head = 2 * cfg.hidden_size * cfg.vocab_size * float(batch["response_len"].sum())
        attn = 2 * cfg.num_hidden_layers * cfg.hidden_size * float((lens * lens).sum())
        return 3 * (body + head + attn)


# ------------------------------------------------------------------------------------------ sections

def sec_schemes(ctx: Ctx) -> dict:
    out = {}
    peak_tflops = ctx.spec.get("peak_bf16_tflops")
    for scheme in SCHEMES:
        try:
            out[scheme] = _scheme_step(ctx, scheme, peak_tflops)
        except Exception as e:  # noqa: BLE001 - one scheme failing leaves the others' numbers
            out[scheme] = {"error": one_line(e)}
            _reset(ctx)
    set_tf32(False)
    return {"rows": ctx.samples * len(ctx.prompts), "new_tokens": ctx.new, "timed_reps": ctx.spec["reps"],
            "peak_bf16_tflops": peak_tflops, "schemes": out}


def _scheme_step(ctx: Ctx, scheme: str, peak_tflops: float | None) -> dict:
    model, opt, undo = scheme_model(ctx.model, scheme)
    reps = []
    for _ in range(ctx.spec["reps"] + 1):  # the first pays for first launches and allocator growth
        r = {}
        ctx.reset_peak()
        r["rollout_s"], comps = ctx.timed(lambda: ctx.rollout(model))
        r["rollout_peak_gib"] = ctx.peak()
        batch = ctx.step_batch(comps)
        ctx.reset_peak()
        r["logprobs_s"], _ = ctx.timed(lambda: compute_logprobs(
            model, batch, ctx.micro_rows(list(range(len(batch))), batch), temperature=1.0, pad_token_id=ctx.pad))
        r["logprobs_peak_gib"] = ctx.peak()
        ctx.reset_peak()
        r["update_s"], _ = ctx.timed(lambda: ctx.update(model, opt, batch))
        r["update_peak_gib"] = ctx.peak()
        r["update_tflop"] = ctx.update_flops(batch) / 1e12
        reps.append(r)
    timed = reps[1:]
    row = {k: statistics.median(x[k] for x in timed) for k in ("rollout_s", "logprobs_s", "update_s",
                                                                 "update_tflop")}
    row.update({k: max((x[k] for x in timed if x[k] is not None), default=None)
                for k in ("rollout_peak_gib", "logprobs_peak_gib", "update_peak_gib")})
    row["step_s"] = row["rollout_s"] + row["logprobs_s"] + row["update_s"]
    row["update_tflops"] = row["update_tflop"] / row["update_s"]
    row["update_mfu"] = row["update_tflops"] / peak_tflops if peak_tflops else None
    undo()
    del model, opt
    ctx.free()
    return row


def busy_share(prof, span_name: str) -> dict:
    """Share of the profiled span in which the device runs a kernel (CUDA), or the host runs an aten op (CPU):
    the union of those intervals over the span's length. The rest is Python, launches and waiting."""
    from torch.autograd import DeviceType

    events = prof.events()
    span = next(e for e in events if e.name == span_name and e.device_type == DeviceType.CPU)
    # the device's copy of each record_function range is an annotation, not work
    cuda = [e for e in events if e.device_type != DeviceType.CPU and e.name not in SPANS]
    work = cuda or [e for e in events if e.name.startswith("aten::")]
    lo, hi = span.time_range.start, span.time_range.end
    spans = sorted((max(e.time_range.start, lo), min(e.time_range.end, hi)) for e in work)
    busy, end = 0.0, lo
    for a, b in spans:
        if b > end:
            busy += b - max(a, end)
            end = b
    return {"busy_share": busy / (hi - lo) if hi > lo else None, "what": "CUDA kernels" if cuda else "aten ops (host)",
            "profiled_s": (hi - lo) / 1e6}


def sec_sampler(ctx: Ctx) -> dict:
    from torch.profiler import ProfilerActivity, profile, record_function

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.dev.type == "cuda" else [])
    out = {}
    for precision in ("fp32", "bf16"):
        if precision == "bf16":
            set_autocast(ctx.model, torch.bfloat16)
        for decoder in ("lean", "static"):  # lean first: a failed graph capture cannot cost its numbers
            arm = {"decoder": decoder, "precision": precision}
            try:
                ctx.rollout(ctx.model, decoder)  # warm-up: first launches, the graph's capture path
                secs = [ctx.timed(lambda: ctx.rollout(ctx.model, decoder))[0] for _ in range(ctx.spec["reps"])]
                with profile(activities=acts) as prof, record_function("sampler"):
                    ctx.rollout(ctx.model, decoder, PROFILED_NEW_TOKENS)
                    ctx.sync()
                s = statistics.median(secs)
                arm.update(seconds=s, tokens_per_s=len(ctx.prompts) * ctx.samples * ctx.new / s,
                           **busy_share(prof, "sampler"))
            except Exception as e:  # noqa: BLE001
                arm["error"] = one_line(e)
            out[f"{decoder}-{precision}"] = arm
        record(ctx.model).autocast = None
    return {"rows": len(ctx.prompts) * ctx.samples, "new_tokens": ctx.new,
            "busy_share_new_tokens": min(ctx.new, PROFILED_NEW_TOKENS), "arms": out}


def sec_precision(ctx: Ctx) -> dict:
    """gpu.py's precision check, on one model load, with TF32 and bf16 parameters among the variants."""
    g = torch.Generator().manual_seed(1)
    rows, new = min(8, len(ctx.prompts)), min(128, ctx.new)
    tokens = [torch.tensor(p + torch.randint(4, len(ctx.tok) - 1, (new,), generator=g).tolist())
              for p in ctx.prompts[:rows]]
    batch = Batch({"tokens": Ragged.of(tokens, torch.long), "response_len": torch.full((rows,), new)})
    adv = torch.randn(rows, generator=g, dtype=torch.float64)

    def run(model, double=False):
        model.zero_grad(set_to_none=True)
        logits, targets, mask = response_logits(model, batch, ctx.pad)
        logp = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0] if double else \
            token_logprobs(logits, targets)
        loss = -(adv.to(ctx.dev, logp.dtype)[:, None] * logp * mask).sum() / mask.sum()
        loss.backward()
        grads = torch.cat([p.grad.reshape(-1).double() for _, p in sorted(model.named_parameters())])
        res = (logp.detach().double()[mask], float(loss.detach()), grads)
        model.zero_grad(set_to_none=True)
        return res

    ref_model = copy.deepcopy(ctx.model).double()
    ref_lp, ref_loss, ref_g = run(ref_model, double=True)
    del ref_model
    ctx.free()
    out = {}
    for scheme in SCHEMES:
        model, _, undo = scheme_model(ctx.model, scheme)
        lp, loss, gr = run(model)
        out[scheme] = {"mean_abs_dlogp": float((lp - ref_lp).abs().mean()),
                       "max_abs_dlogp": float((lp - ref_lp).abs().max()),
                       "loss_rel_err": abs(loss - ref_loss) / max(abs(ref_loss), 1e-30),
                       "grad_rel_err": float((gr - ref_g).norm() / ref_g.norm())}
        undo()
        del model, gr
        ctx.free()
    set_tf32(False)
    tf32 = out["fp32-tf32"]
    return {"rows": rows, "response_tokens": new, "reference": "float64", "variants": out, "bf16_bounds": BF16_BOUNDS,
            "tf32_within_bf16_bounds": all(tf32[k] <= v for k, v in BF16_BOUNDS.items()),
            "tf32_note": None if ctx.dev.type == "cuda" else "TF32 is a CUDA matmul mode: on CPU it equals fp32"}


def sec_adamw(ctx: Ctx) -> dict:
    params = [p for p in ctx.model.parameters() if p.requires_grad]
    out = {}
    for kind in ("fused", "foreach"):
        opt = torch.optim.AdamW(params, lr=1e-12, fused=kind == "fused", foreach=None if kind == "fused" else True)
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3
        secs = [ctx.timed(opt.step)[0] for _ in range(1 + ctx.spec["reps"] * 2)][1:]
        out[kind] = {"step_ms": 1e3 * statistics.median(secs)}
        opt.zero_grad(set_to_none=True)
        del opt
        ctx.free()
    return {"params": sum(p.numel() for p in params), "optimizer": out}


def sec_trace(ctx: Ctx) -> dict:
    """torch.profiler over one optimizer step of the update (forward, backward, clip, AdamW over the first of the
    step's two mini-batches) in bf16 autocast. One step, not the whole RL step: the 2026-11-27 trace of a rollout,
    the log-probs and both mini-batches was stopped at its 55 s cap on an H200 walking its events (estimate 30 s,
    40 since), and the sampler's busy share is the sampler section's."""
    from torch.profiler import ProfilerActivity, profile, record_function

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.dev.type == "cuda" else [])
    model, opt, undo = scheme_model(ctx.model, "bf16-autocast")
    batch = ctx.step_batch()  # the step's shapes: every row a prompt + new_tokens random response tokens
    half = batch.select(list(range(len(batch) // 2)))  # one mini-batch: one optimizer step
    ctx.update(model, opt, half, minibatches=1)  # warm-up outside the trace
    with profile(activities=acts) as prof, record_function("update"):
        ctx.update(model, opt, half, minibatches=1)
        ctx.sync()
    undo()
    out_dir = Path(ctx.spec["out"])
    raw = Path(ctx.spec["work"]) / f"{TRACE}.json"
    prof.export_chrome_trace(str(raw))
    gz = out_dir / f"{TRACE}.json.gz"
    with raw.open("rb") as f, gzip.open(gz, "wb", compresslevel=6) as g:
        shutil.copyfileobj(f, g)
    kept = gz.stat().st_size <= ctx.spec.get("max_file_bytes", 15 * 2**20)
    if not kept:  # the device tool brings back files of at most 16 MiB
        gz.unlink()
    sort = "self_device_time_total" if ctx.dev.type == "cuda" else "self_cpu_time_total"  # torch >= 2.4's names
    text = prof.key_averages().table(sort_by=sort, row_limit=60)
    (out_dir / f"{TRACE}.txt").write_text(f"one bf16-autocast optimizer step of the update ({len(half)} rows, "
                                          f"{int(half['tokens'].lengths.sum())} tokens), sorted by {sort}\n{text}\n")
    phases = {"update": busy_share(prof, "update")}
    del opt
    ctx.free()
    return {"trace": gz.name if kept else None, "trace_bytes": raw.stat().st_size, "rows": len(half),
            "trace_note": None if kept else "the gzipped trace was over 15 MiB and was not kept",
            "top_ops": f"{TRACE}.txt", "phases": phases}


def sec_compile(ctx: Ctx) -> dict:
    eager = forward_module.split_forward
    compiled = torch.compile(eager, dynamic=True)
    model, opt, undo = scheme_model(ctx.model, "bf16-autocast")
    batch = ctx.step_batch()
    try:
        eager_s = [ctx.timed(lambda: ctx.update(model, opt, batch))[0] for _ in range(ctx.spec["reps"] + 1)][1:]
        forward_module.split_forward = compiled  # the training forward's packed path, looked up per call
        first_s, _ = ctx.timed(lambda: ctx.update(model, opt, batch))
        comp_s = [ctx.timed(lambda: ctx.update(model, opt, batch))[0] for _ in range(ctx.spec["reps"])]
    finally:
        forward_module.split_forward = eager
        undo()
    flops, peak = ctx.update_flops(batch) / 1e12, ctx.spec.get("peak_bf16_tflops")
    e, c = statistics.median(eager_s), statistics.median(comp_s)
    return {"scheme": "bf16-autocast", "eager_update_s": e, "compiled_update_s": c,
            "first_compiled_call_s": first_s, "compile_s": first_s - c, "speedup": e / c,
            "eager_tflops": flops / e, "compiled_tflops": flops / c,
            "eager_mfu": flops / e / peak if peak else None, "compiled_mfu": flops / c / peak if peak else None}


def sec_ceiling(ctx: Ctx) -> dict:
    # the bf16 matrix-product ceiling as measured here (METHOD.md: measure the ceilings once). Timed by repeats until
    # 0.25 s have passed, so the section's time does not depend on the machine's speed or load (a loaded 2-core CPU
    # took over its 11.5 s cap for 51 fixed products of 512 x 512)
    n = 8192 if ctx.dev.type == "cuda" else 256
    a, b = (torch.randn(n, n, device=ctx.dev, dtype=torch.bfloat16) for _ in range(2))
    a @ b
    secs = []
    for _ in range(5):
        count, t0 = 0, time.perf_counter()
        while True:
            a @ b
            count += 1
            ctx.sync()
            if time.perf_counter() - t0 > 0.25:
                break
        secs.append((time.perf_counter() - t0) / count)
    return {"n": n, "bf16_matmul_tflops": 2 * n**3 / statistics.median(secs) / 1e12}


SECTIONS = {"ceiling": sec_ceiling, "schemes": sec_schemes, "precision": sec_precision, "adamw": sec_adamw,
            "trace": sec_trace, "attention": sec_attention, "moe": sec_moe, "sampler": sec_sampler,
            "compile": sec_compile}


def _reset(ctx: Ctx) -> None:
    """What a failed section may have left switched on."""
    set_tf32(False)
    record(ctx.model).autocast = None
    ctx.free()


class OverCap(BaseException):  # not an Exception: the per-arm guards inside a section must not swallow it
    pass


def _over_cap(signum, frame):
    raise OverCap("stopped at its time cap (1.5 x its estimate + 10 s)")


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    signal.signal(signal.SIGALRM, _over_cap)
    results = Path(spec["result_file"])

    def write(line: dict) -> None:
        with results.open("a") as f:
            f.write(json.dumps(line) + "\n")

    torch.manual_seed(0)
    t0 = time.perf_counter()
    ctx = Ctx(spec)
    write({"name": "load", "seconds": time.perf_counter() - t0, "result": {"params": ctx.params}})
    for name in spec["sections"]:
        left = spec["deadline"] - time.time()
        need = spec["estimates"].get(name, 0)
        line: dict = {"name": name}
        if left < need:
            line["skipped"] = f"budget: {left:.0f} s left before the deadline, the section needs ~{need:.0f} s"
        else:
            t = time.perf_counter()
            signal.setitimer(signal.ITIMER_REAL, min(1.5 * need + 10, left))  # leaves the next ones their time
            try:
                line["result"] = SECTIONS[name](ctx)
            except (Exception, OverCap) as e:  # noqa: BLE001 - reported in the table; the next section still runs
                line["error"] = one_line(e)
                _reset(ctx)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            line["seconds"] = time.perf_counter() - t
        write(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
