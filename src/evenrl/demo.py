"""The demo behind `make demo`: a tiny model learns one-digit addition on 2 CPU cores in a few minutes.

    evenrl demo                          # SFT warm start, then GRPO; prints first/last-10-step rewards
    evenrl demo --nproc-per-node 2       # the GRPO phase on two processes (what make demo runs)
    evenrl demo --task tools             # multi-turn: the model learns to use a calculator tool (docs/multiturn.md)

1. makes a random 81 K-parameter Qwen2 model with a character tokenizer in runs/demo/model (no download);
2. writes the task: prompts "3+5=" with answers "8" (a, b in 0..9), runs/demo/data/addition.jsonl;
3. a short supervised warm start (evenrl sft) so greedy answers are mostly right but samples are not
   (RL sharpens what the model half-knows: with too little SFT the reward barely moves);
4. GRPO (evenrl train) with an exact-match reward, config examples/demo.yaml;
5. plots (evenrl report) and the mean reward of the first and last 10 steps.

`--task tools` does the same with 3-4-digit additions the model cannot do in its head: the warm start teaches it to
call the `calculator` tool in the Hermes format and to copy the tool's result into its answer (its two turns, as the
chat template renders them) on 2000 problems, then GRPO on whole trajectories (rollout.env=calculator, config
examples/tools.yaml) on 64 others raises the share of them it gets right; the report adds turns per trajectory and
the tool-call success rate.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

from evenrl.config import load_config
from evenrl.errors import ArgumentParser, UsageError

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
# The tools demo's model: copying 3-4-digit numbers into a tool call and the tool's result into an answer takes more
# than the addition demo's 81 K parameters.
TOOLS_MODEL = dict(hidden=96, layers=2, heads=4, seed=0)
SFT_PROMPT_TOKENS = 192  # the warm start's longest prompt: the conversation up to the tool's answer


def write_addition_data(path: Path, seed: int = 0) -> int:
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10) for b in range(10)]
    random.Random(seed).shuffle(rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return len(rows)


def write_tool_data(out: Path, tokenizer, n_train: int = 2000, n_rl: int = 64) -> dict[str, Path]:
    """The tools demo's files: the warm start's rows for `n_train` problems (per problem, the prompt rendered as the
    trajectory's turn 0 sees it -> the tool call, and the conversation up to the tool's answer -> the answer: the
    chat template's text, so the tokens are those a trajectory holds), and `n_rl` other problems ("123+4567=" ->
    "4690") that GRPO trains on and the greedy evaluation scores, as the addition demo's 100 prompts."""
    from evenrl.envs.builtin import addition_rows
    from evenrl.envs.template import tokenizer_render
    from evenrl.envs.toolcalls import tool_schemas
    from evenrl.envs.tools import calculator

    render, tools = tokenizer_render(tokenizer), tool_schemas([calculator])
    sft = []
    for row in addition_rows(n_train, seed=1):
        expression = row["prompt"].rstrip("=")
        call = '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>' % expression
        user = [{"role": "user", "content": row["prompt"]}]
        reply = user + [{"role": "assistant", "content": call}, {"role": "tool", "content": calculator(expression)}]
        sft += [{"prompt": render(user, tools, True), "answer": call},
                {"prompt": render(reply, tools, True), "answer": row["answer"]}]
    files = {"train": addition_rows(n_rl, seed=2), "sft": sft}
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in files.items():
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {name: out / f"{name}.jsonl" for name in files}


def _config_path(name: str = "demo.yaml") -> Path:
    path = EXAMPLES / name
    if not path.exists():
        raise UsageError(f"{path}: missing; the demo runs from a checkout of the evenrl repository (make demo)")
    return path


def main(argv: list[str]) -> int:
    p = ArgumentParser(prog="evenrl demo", description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="where the model, data and runs go (runs/demo, runs/demo-tools)")
    p.add_argument("--nproc-per-node", type=int, default=1, help="processes for the GRPO phase")
    p.add_argument("--task", choices=("addition", "tools"), default="addition",
                   help="addition: one-digit sums, single turn; tools: 3-4-digit sums with a calculator tool")
    p.add_argument("overrides", nargs="*", help="dotted overrides of examples/demo.yaml (tools: examples/tools.yaml), "
                                                "e.g. train.steps=50 sft.steps=100")
    args = p.parse_args(argv)
    out = Path(args.out or ("runs/demo" if args.task == "addition" else "runs/demo-tools"))
    cfg_path = _config_path("demo.yaml" if args.task == "addition" else "tools.yaml")
    t0 = time.time()

    from evenrl.testing import make_tiny_model

    if args.task == "tools":
        from transformers import AutoTokenizer

        model_dir = make_tiny_model(str(out / "model"), arch="qwen2", chat_template="tools", **TOOLS_MODEL)
        files = write_tool_data(out / "data", AutoTokenizer.from_pretrained(model_dir))
        n = sum(1 for _ in files["train"].open())
        print(f"[demo] tiny Qwen2 model with a tool-calling template in {model_dir}; addition prompts in "
              f"{out / 'data'}")
        common = [f"data.path={files['train']}", f"eval.path={files['train']}"]  # as the addition demo: all of them
        sft_data = [f"data.path={files['sft']}", f"data.max_prompt_tokens={SFT_PROMPT_TOKENS}"]
    else:
        model_dir = make_tiny_model(str(out / "model"), arch="qwen2", seed=0)
        data = out / "data" / "addition.jsonl"
        n = write_addition_data(data)
        print(f"[demo] tiny Qwen2 model in {model_dir}; {n} addition prompts in {data}")
        common = [f"data.path={data}", f"eval.path={data}"]  # 100 prompts: the task is all of them
        sft_data = []
    sft_dir = out / "sft"
    sft_cfg = load_config(cfg_path, common + [*args.overrides, *sft_data, f"model.path={model_dir}",
                                              f"log.run_dir={sft_dir}"])
    print(f"[demo] supervised warm start: {sft_cfg.sft.steps} steps of {sft_cfg.sft.rows_per_step} rows")
    from evenrl.train.sft import sft

    sft(sft_cfg, overwrite=True)  # the demo owns runs/demo: a second `make demo` starts afresh
    print(f"[demo] warm start done in {time.time() - t0:.0f} s")

    grpo_dir = out / "grpo"
    overrides = common + [f"model.path={sft_dir / 'final'}", f"log.run_dir={grpo_dir}", *args.overrides]
    cmd = [sys.executable, "-m", "evenrl.cli", "train", str(cfg_path), *overrides,
           "--nproc-per-node", str(args.nproc_per_node), "--overwrite"]
    print("[demo] GRPO:", " ".join(cmd[2:]))
    # one process gets both cores, unless bitwise, which computes with one thread per process (train.determinism)
    alone = args.nproc_per_node == 1 and sft_cfg.train.reproducibility != "bitwise"
    rc = subprocess.call(cmd, env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS",
                                                                                  "2" if alone else "1")})
    if rc != 0:
        print(f"[demo] training failed with exit code {rc}", file=sys.stderr)
        return rc

    from evenrl.report import write_plots
    from evenrl.train.runlog import read_metrics

    rows = [r for r in read_metrics(grpo_dir) if "reward/mean" in r]
    evals = [r["eval/reward"] for r in read_metrics(grpo_dir) if "eval/reward" in r]
    plots = write_plots(grpo_dir)
    shown = [("reward/mean", "mean reward"), ("tools/success_rate", "tool-call success rate"),
             ("rollout/turns_mean", "turns per trajectory")]
    for i, (key, name) in enumerate(shown):
        series = [r[key] for r in rows if key in r]
        if series:
            first, last = series[:10], series[-10:]
            head = f"{len(rows)} GRPO steps; " if i == 0 else ""
            print(f"[demo] {head}{name} first 10 steps {sum(first) / len(first):.3f} "
                  f"-> last 10 steps {sum(last) / len(last):.3f}")
    if len(evals) >= 2:
        n = next((r["eval/prompts"] for r in read_metrics(grpo_dir) if "eval/prompts" in r), n)
        what = (f"greedy exact-match on all {n} prompts" if args.task == "addition" else
                f"greedy trajectories right on all {n} prompts")
        print(f"[demo] {what}: before GRPO {evals[0]:.3f} -> after {evals[-1]:.3f}")
    print(f"[demo] run directory: {grpo_dir}  (config.yaml, plan.txt, metrics.jsonl, samples.jsonl, tb/, final/)")
    print(f"[demo] plots: {', '.join(str(p) for p in plots)}")
    print(f"[demo] total {time.time() - t0:.0f} s")
    return 0
