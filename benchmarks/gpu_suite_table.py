"""benchmarks/gpu_suite.py's markdown: its JSON as tables, the issue's targets, and what the numbers say about the
defaults (decoder, TF32, bf16 scheme, compile). Reads the JSON only: `python3 benchmarks/gpu_suite_table.py
OUT/gpu_suite.json` rewrites the table from a run brought home."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def f(x, spec=".2f", none="-") -> str:
    return none if x is None or x != x else format(x, spec)


def _sections(res: dict) -> dict:
    return {s["name"]: s for s in res["sections"]}


def _ran(secs: dict, name: str) -> dict | None:
    s = secs.get(name)
    return s["result"] if s and s["status"] == "ran" and s.get("result") else None


def _steps(secs: dict) -> list[str]:
    lines = ["| arm | runs as | step s | samples/s | rollout / log-probs / update s | update TFLOP/s (MFU) | "
             "peak GiB rollout / log-probs / update, measured | planned (incl. 1 GiB overhead) |",
             "|---|---|---|---|---|---|---|---|"]
    for name, s in secs.items():
        if s["group"] != "train" or s["status"] != "ran":
            continue
        r = s["result"]
        ph, pk = r["phase_s"], r.get("peak_gib") or {}
        plan = (r.get("plan") or {}).get("phases_gib", {})
        lines.append(f"| {name} | `evenrl train` | {f(r['step_s'])} | {f(r['samples_per_s'], '.1f')} | "
                     f"{f(ph['rollout'])} / {f(ph['logprobs'])} / {f(ph['update'])} | - | "
                     f"{f(pk.get('rollout'), '.1f')} / {f(pk.get('logprobs'), '.1f')} / {f(pk.get('update'), '.1f')} | "
                     f"{f(plan.get('rollout'), '.1f')} / {f(plan.get('log-probs'), '.1f')} / "
                     f"{f(plan.get('update'), '.1f')} |")
    sch = _ran(secs, "schemes")
    for scheme, r in (sch or {}).get("schemes", {}).items():
        if "error" in r:
            lines.append(f"| {scheme} | in-process phases | failed: {r['error']} | | | | | |")
            continue
        lines.append(f"| {scheme} | in-process phases | {f(r['step_s'])} | {f(sch['rows'] / r['step_s'], '.1f')} | "
                     f"{f(r['rollout_s'])} / {f(r['logprobs_s'])} / {f(r['update_s'])} | "
                     f"{f(r['update_tflops'], '.3g')} ({f(r['update_mfu'], '.1%')}) | "
                     f"{f(r['rollout_peak_gib'], '.1f')} / {f(r['logprobs_peak_gib'], '.1f')} / "
                     f"{f(r['update_peak_gib'], '.1f')} | - |")
    return lines if len(lines) > 2 else []


def _sampler(secs: dict) -> list[str]:
    r = _ran(secs, "sampler")
    if not r:
        return []
    lines = [f"Sampler alone: {r['rows']} rows x {r['new_tokens']} new tokens, no EOS (busy share: over a profiled "
             f"rollout of {r.get('busy_share_new_tokens', r['new_tokens'])} new tokens)", "",
             "| decoder | precision | tokens/s | seconds | busy share (what is busy) |", "|---|---|---|---|---|"]
    for a in r["arms"].values():
        if "error" in a:
            lines.append(f"| {a['decoder']} | {a['precision']} | failed: {a['error']} | | |")
            continue
        lines.append(f"| {a['decoder']} | {a['precision']} | {f(a['tokens_per_s'], ',.0f')} | {f(a['seconds'], '.3f')} "
                     f"| {f(a['busy_share'], '.0%')} ({a['what']}) |")
    return lines


def _throughput_arms(secs: dict) -> dict:
    """The arms of both trainer-throughput sections (16 K, 64 K) that ran or tried to."""
    return {n: a for name in ("trainer-throughput", "trainer-throughput-64k")
            for n, a in (_ran(secs, name) or {}).get("arms", {}).items()}


def _throughput(secs: dict) -> list[str]:
    arms = _throughput_arms(secs)
    if not arms:
        return []
    where = next((a["result"]["prime_rl"]["where"] for a in arms.values()
                  if a["status"] == "ran" and a["result"].get("prime_rl")), "prime-rl: no published row")
    lines = ["Trainer only (benchmarks/trainer_throughput.py: evenrl's update on prime-rl's fake data, MFU by "
             f"prime-rl's formula), prime-rl's published numbers beside ({where})", "",
             "| arm | runs as | tokens/s | MFU | peak GiB reserved (allocated) | step s | forward | prime-rl tokens/s | "
             "MFU | GiB |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, a in arms.items():
        if a["status"] != "ran":
            lines.append(f"| {name} | {a['status']}: {a['reason']} | | | | | | | | |")
            continue
        x, p = a["result"], a["result"].get("prime_rl") or {}
        mem = x["memory"]
        gib = (f"{f(mem['peak_reserved_gib'], '.1f')} ({f(mem['peak_allocated_gib'], '.1f')})"
               if "peak_reserved_gib" in mem else f"{f(mem['peak_rss_gib'], '.2f')} (RSS)")
        how = (f"{x['model']}{' LoRA r=' + str(x['lora_rank']) if x['lora_rank'] else ''}, {x['micro_batches']} x "
               f"{x['seq_len']} tokens")
        lines.append(f"| {name} | {how} | {f(x['tokens_per_s'], ',.0f')} | {f(x['mfu'], '.1%')} | {gib} | "
                     f"{' / '.join(f(t) for t in x['step_s'])} | {x['forward_path']} | "
                     f"{f(p.get('tokens_per_s'), ',.0f')} | {f(p.get('mfu'), '.1%')} | {f(p.get('peak_gib'), '.1f')} |")
    return lines


def _precision(secs: dict) -> list[str]:
    r = _ran(secs, "precision")
    if not r:
        return []
    lines = [f"Against float64 ({r['rows']} rows x {r['response_tokens']} response tokens); bf16 bounds "
             f"{r['bf16_bounds']}; TF32 within them: {r['tf32_within_bf16_bounds']}"
             + (f" ({r['tf32_note']})" if r.get("tf32_note") else ""), "",
             "| variant | mean abs dlogp | max abs dlogp | loss rel err | grad rel err |", "|---|---|---|---|---|"]
    for name, v in r["variants"].items():
        lines.append(f"| {name} | {f(v['mean_abs_dlogp'], '.2e')} | {f(v['max_abs_dlogp'], '.2e')} | "
                     f"{f(v['loss_rel_err'], '.2e')} | {f(v['grad_rel_err'], '.2e')} |")
    return lines


def _paths(secs: dict) -> list[str]:
    lines = []
    if (r := _ran(secs, "attention")):
        lines += [f"Training forward + backward by path ({r['precision']}): {r['rows']} rows, responses up to "
                  f"{r['longest_response']} tokens (lognormal), {r['real_tokens']} real tokens, padding "
                  f"{f(r['padding_share'], '.0%')} of the right-padded shape", "",
                  "| path | fwd+bwd s | real tokens/s | max abs dlogp vs masked |", "|---|---|---|---|"]
        for name, p in r["paths"].items():
            lines.append(f"| {name} | failed: {p['error']} | | |" if "error" in p else
                         f"| {name} | {f(p['fwd_bwd_s'], '.4f')} | {f(p['real_tokens_per_s'], ',.0f')} | "
                         f"{f(p['max_abs_dlogp_vs_masked'], '.2e')} |")
    if (r := _ran(secs, "moe")):
        lines += ([""] if lines else []) + [
            f"MoE block forward + backward ({r['dtype']}): {r['experts']} experts, top-{r['top_k']}, hidden "
            f"{r['hidden']}, expert width {r['expert_width']}, {r['tokens']} tokens", "",
            "| experts backend | fwd+bwd s | tokens/s | expert TFLOP/s | max abs dy vs first |", "|---|---|---|---|---|"]
        for name, p in r["backends"].items():
            lines.append(f"| {name} | failed: {p['error']} | | | |" if "error" in p else
                         f"| {name} | {f(p['fwd_bwd_s'], '.4f')} | {f(p['tokens_per_s'], ',.0f')} | "
                         f"{f(p['expert_tflops'], '.3g')} | {f(p['max_abs_dy_vs_first'], '.2e')} |")
    return lines


def _misc(secs: dict) -> list[str]:
    lines = []
    if (r := _ran(secs, "ceiling")):
        lines.append(f"- bf16 matmul ceiling measured here ({r['n']}^3): {f(r['bf16_matmul_tflops'], '.3g')} TFLOP/s")
    if (r := _ran(secs, "adamw")):
        o = r["optimizer"]
        lines.append(f"- AdamW step over {r['params'] / 1e6:.3g} M fp32 parameters: fused "
                     f"{f(o['fused']['step_ms'])} ms, foreach {f(o['foreach']['step_ms'])} ms")
    if (r := _ran(secs, "compile")):
        lines.append(f"- torch.compile of the packed training forward ({r['scheme']} update): eager "
                     f"{f(r['eager_update_s'], '.3f')} s, compiled {f(r['compiled_update_s'], '.3f')} s "
                     f"({f(r['speedup'])}x; MFU {f(r['eager_mfu'], '.1%')} -> {f(r['compiled_mfu'], '.1%')}), compile "
                     f"{f(r['compile_s'], '.1f')} s once")
    if (r := _ran(secs, "trace")):
        ph = "; ".join(f"{k} {f(v['busy_share'], '.0%')} busy over {f(v['profiled_s'], '.2f')} s"
                       for k, v in r["phases"].items())
        lines.append(f"- profiler trace of one bf16 optimizer step of the update ({r.get('rows')} rows): "
                     f"{r['trace'] or r['trace_note']}, top ops in {r['top_ops']}; "
                     f"{ph} ({next(iter(r['phases'].values()))['what']})")
    if (r := _ran(secs, "vllm-moe")):
        lines.append(f"- vLLM, a tiny Qwen3-MoE: tensors differing from a fresh load after vLLM's reload alone "
                     f"{len(r['vllm_reload_alone'])}, after evenrl's push of changed weights "
                     f"{len(r['push_changed_vs_fresh'])}; max |engine - trainer| log-prob pushed "
                     f"{f(r['logprob_gap_pushed'], '.2g')}, fresh {f(r['logprob_gap_fresh'], '.2g')}")
    if (r := _ran(secs, "vs-trl")):
        lines.append(f"- evenrl vs TRL GRPO ({r['dtype']}): median ratio evenrl/TRL samples/s "
                     f"{f(r['median_ratio'])}x over {len(r['pairs'])} pairs ({', '.join(f(x) for x in r['ratios'])}); "
                     f"TRL {f(r['trl_samples_per_s'], '.1f')}, evenrl {f(r['evenrl_samples_per_s'], '.1f')} samples/s")
    return lines


def verdicts(res: dict) -> list[str]:
    """The issue's targets and what the numbers say about each default; 'not measured' where a section did not run."""
    secs = _sections(res)
    sch = {k: v for k, v in (_ran(secs, "schemes") or {}).get("schemes", {}).items() if "error" not in v}
    smp = {k: v for k, v in (_ran(secs, "sampler") or {}).get("arms", {}).items() if "error" not in v}
    prec, comp, trl = _ran(secs, "precision"), _ran(secs, "compile"), _ran(secs, "vs-trl")
    step = {n: (_ran(secs, n) or {}).get("step_s") for n in ("step-fp32", "step-bf16-autocast", "step-fp32-tf32")}
    out = []
    fp32 = step["step-fp32"] or (sch.get("fp32") or {}).get("step_s")
    cands = [x for x in (step["step-bf16-autocast"], (sch.get("bf16-autocast") or {}).get("step_s"),
                         (sch.get("bf16-params") or {}).get("step_s")) if x]
    bf16 = min(cands) if cands else None
    out.append("- target bf16 step <= 0.6x fp32: " + (f"{bf16 / fp32:.2f}x" if fp32 and bf16 else "not measured"))
    best = max((a["tokens_per_s"] for a in smp.values()), default=None)
    out.append("- target sampler >= 30 k tokens/s at 64 rows: "
               + (f"{best:,.0f} (best arm)" if best else "not measured"))
    mfu = max([r["update_mfu"] for r in sch.values() if r.get("update_mfu")] +
              ([comp["compiled_mfu"]] if comp and comp.get("compiled_mfu") else []), default=None)
    out.append("- target update >= 35% MFU: " + (f"{mfu:.1%} (best)" if mfu else "not measured (no bf16 peak known)"))
    tt = [(n, a["result"]) for n, a in _throughput_arms(secs).items()
          if a["status"] == "ran" and a["result"].get("prime_rl")]
    out.append("- target trainer-only >= prime-rl's tokens/s and MFU at its shapes: " + (
        "; ".join(f"{n} {x['tokens_per_s'] / x['prime_rl']['tokens_per_s']:.2f}x its tokens/s, MFU "
                  f"{f(x['mfu'], '.1%')} vs {x['prime_rl']['mfu']:.1%}" for n, x in tt) or "not measured"))
    out.append("- target evenrl >= 2x TRL samples/s: " + (f"{trl['median_ratio']:.2f}x" if trl else "not measured"))
    if smp:
        wins = [p for p in ("fp32", "bf16") if f"static-{p}" in smp and f"lean-{p}" in smp
                and smp[f"static-{p}"]["tokens_per_s"] > smp[f"lean-{p}"]["tokens_per_s"]]
        out.append(f"- rollout.decoder auto -> static on CUDA: static faster than lean in {wins or 'neither'} "
                   "precision")
    if prec:
        faster = step["step-fp32-tf32"] and fp32 and step["step-fp32-tf32"] < fp32
        out.append(f"- TF32 for fp32 runs: error within the bf16 bounds: {prec['tf32_within_bf16_bounds']}; "
                   f"faster step: {'not measured' if not step['step-fp32-tf32'] else bool(faster)}")
    if sch.get("bf16-autocast") and sch.get("bf16-params"):
        a, p = sch["bf16-autocast"]["step_s"], sch["bf16-params"]["step_s"]
        out.append(f"- bf16 scheme: {'bf16 parameters + fp32 master' if p < a else 'autocast'} is faster "
                   f"(in-process step: bf16-params {f(p)} s, bf16-autocast {f(a)} s)")
    if comp:
        out.append(f"- compile: {f(comp['speedup'])}x on the update for {f(comp['compile_s'], '.0f')} s of compile")
    return out


def markdown(res: dict) -> str:
    d, secs = res["device"], _sections(res)
    where = d.get("gpu", "CPU") + (f", driver {d['driver']}" if d.get("driver") else "")
    lines = [f"# evenrl GPU suite: {where}, torch {d['torch']}, transformers {d['transformers']}", "",
             f"Budget {res['budget_s']:.0f} s, wall {f(res['wall_s'], '.0f')} s; model "
             f"{(res.get('model') or {}).get('shape_name', 'not built')}; workload {res['workload']}; "
             f"command `gpu_suite.py {' '.join(res['argv'])}`", "",
             "| section | status | seconds | estimate s | reason |", "|---|---|---|---|---|"]
    for s in res["sections"]:
        lines.append(f"| {s['name']} | {s['status']} | {f(s['seconds'], '.1f')} | {f(s['estimate_s'], '.0f')} | "
                     f"{s['reason'] or ''} |")
    parts = (_steps(secs), _throughput(secs), _sampler(secs), _precision(secs), _paths(secs), _misc(secs),
             ["Targets and defaults:"] + verdicts(res))
    for part in parts:
        if part:
            lines += [""] + part
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    text = markdown(json.loads(Path(sys.argv[1]).read_text()))
    print(text)
