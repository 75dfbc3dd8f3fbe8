"""Agent rollouts against rollout.env on the same task: trajectories/s and the endpoint's overhead per call.

Run: .venv/bin/python benchmarks/agents.py [--prompts 8] [--samples 8] [--steps 3] [--max-new-tokens 16]

The task is the built-in `feedback` environment's: the model answers an addition problem, is told "That is not right.
Try again." and answers again, up to 3 turns (reward 2^-(k-1) for a right answer at turn k). Both paths run it on
the same tiny random Qwen2 (tool-calling template) with the hf engine in this process:
  env     rollout.env=feedback: evenrl.rollout.trajectories.Turns, turns in lockstep, the environment's steps in the
          reward workers;
  agent   rollout.agent=agents:feedback (below): the same conversation written with the openai client, run in the
          reward workers against the endpoint (HTTP over the worker's loopback, FastAPI/uvicorn, a Unix socket),
          its requests served in batches as they arrive, then assembled by token prefix.
Per path, medians over --steps steps after one warm-up step (workers started, modules imported): trajectories/s
(wall time of the rollout), engine calls, the engine's own seconds (engine.generate timed), and per model call:
  overhead  (wall - engine) / calls: everything that is not sampling (environment steps and rendering for env;
            the agent's own code, its HTTP client, the relay, the server, rendering and assembly for agent);
  serving   agent only: the rollout thread's own time per call outside the engine (rendering, splicing, recording,
            the answer's JSON), what the endpoint costs the trainer's thread.
Nothing here asserts speed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

from openai import AsyncOpenAI

RETRY = "That is not right. Try again."


async def feedback(row, *, base_url, model, api_key):
    """The feedback environment as an agent: up to 3 answers, told to try again after a wrong one."""
    from evenrl.rewards.math import math_reward

    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": row["prompt"]}]
    for turn in range(3):
        text = (await client.chat.completions.create(model=model, messages=messages)).choices[0].message.content
        if math_reward(text or "", row) == 1.0:
            return 0.5 ** turn
        messages += [{"role": "assistant", "content": text or ""}, {"role": "user", "content": RETRY}]
    return 0.0


class Timed:
    """An engine whose generate calls are counted and timed."""

    def __init__(self, engine):
        self.engine, self.name, self.needs_weights = engine, engine.name, engine.needs_weights
        self.calls, self.rows, self.seconds = 0, 0, 0.0

    def generate(self, requests, params):
        start = time.perf_counter()
        out = self.engine.generate(requests, params)
        self.seconds += time.perf_counter() - start
        self.calls, self.rows = self.calls + 1, self.rows + sum(len(x) for x in out)
        return out

    def sleep(self):
        self.engine.sleep()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    args = ap.parse_args()

    from evenrl.config import RunConfig
    from evenrl.engines.base import Request, sampling_params
    from evenrl.engines.hf import HFEngine
    from evenrl.envs.builtin import addition_rows
    from evenrl.models.loading import load_policy
    from evenrl.testing import make_tiny_model
    from evenrl.rollout.trajectories import make_turns

    root = tempfile.mkdtemp(prefix="evenrl-bench-agents-")
    model = make_tiny_model(f"{root}/model", chat_template="tools", seed=0)
    data = f"{root}/rows.jsonl"
    with open(data, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in addition_rows(args.prompts, digits=(1, 1)))
    policy, tok = load_policy(model)
    base = {"model": {"path": model}, "data": {"path": data, "max_prompt_tokens": 64},
            "rewards": {"timeout_s": 30.0}}
    rollout = {"samples_per_prompt": args.samples, "max_new_tokens": args.max_new_tokens,
               "max_trajectory_tokens": 256}
    paths = {"env": {**rollout, "env": "feedback", "max_turns": 3},
             "agent": {**rollout, "agent": "agents:feedback", "agent_max_calls": 3, "agent_timeout_s": 120.0}}
    rows_out = []
    for name, settings in paths.items():
        cfg = RunConfig.model_validate({**base, "rollout": settings})
        loop = make_turns(cfg)
        rows, tokens, openings, _ = loop.load(tok)
        times, calls, engine_s, model_calls, rewards, serving = [], [], [], [], [], []
        busy = [0.0]
        if name == "agent":  # the rollout thread's time serving requests (engine included), timed from outside
            serve = loop._serve

            def timed_serve(*a, serve=serve):
                start = time.perf_counter()
                serve(*a)
                busy[0] += time.perf_counter() - start
            loop._serve = timed_serve
        for step in range(args.steps + 1):
            engine = Timed(HFEngine(policy, eos_token_ids={tok.eos_token_id}, pad_token_id=tok.pad_token_id))
            busy[0] = 0.0
            start = time.perf_counter()
            asks = [Request(t, i, step + 1, range(args.samples)) for i, t in enumerate(tokens)]
            out = loop.generate(engine, asks, sampling_params(cfg), rows=rows, openings=openings)
            wall = time.perf_counter() - start
            done = [t for ts in out for t in ts]
            if step == 0:
                continue  # warm-up: workers started, modules imported
            times.append(wall)
            calls.append(engine.calls)
            engine_s.append(engine.seconds)
            model_calls.append(sum(t.turns for t in done))
            rewards.append(sum(t.reward for t in done) / len(done))
            serving.append((busy[0] - engine.seconds) / model_calls[-1])
        wall, eng, n = statistics.median(times), statistics.median(engine_s), statistics.median(model_calls)
        rows_out.append((name, len(rows) * args.samples / wall, n, statistics.median(calls), eng,
                         1000 * (wall - eng) / n, 1000 * statistics.median(serving) if name == "agent" else None,
                         statistics.median(rewards)))
    print(f"{args.prompts} prompts x {args.samples} samples, feedback task (up to 3 turns of {args.max_new_tokens} "
          f"tokens), hf engine, medians over {args.steps} steps")
    print(f"{'path':6} {'traj/s':>8} {'model calls':>12} {'engine calls':>13} {'engine s':>9} "
          f"{'overhead ms/call':>17} {'serving ms/call':>16} {'reward':>7}")
    for name, rate, n, ecalls, eng, over, serving, reward in rows_out:
        shown = "-" if serving is None else f"{serving:.1f}"
        print(f"{name:6} {rate:8.1f} {n:12.0f} {ecalls:13.0f} {eng:9.2f} {over:17.1f} {shown:>16} {reward:7.3f}")


if __name__ == "__main__":
    main()
