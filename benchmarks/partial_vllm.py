"""Continuing cut samples on vLLM (CPU build): re-prefilling the kept prefix, as evenrl's partial rollouts do, against
vLLM's keep-mode pause (pause_generation(mode="keep") / resume_generation: the requests stay in the engine with their
KV cache), each against generating the samples whole.

Run: .venv/bin/python benchmarks/partial_vllm.py [--requests 32 --cut 128 --total 256 --hidden 256 --layers 4]

A random Qwen2 (head size 64; vLLM's CPU attention takes 32, 64, 80, ...), `requests` prompts of 16 tokens, every
request made to sample exactly `total` tokens (EOS ignored), on one AsyncLLM engine (its core in a child process).
  whole      one request per sample to `total` tokens
  re-prefill requests to `cut` tokens, then prompt + those tokens as new requests (seeded anew) to the rest: the
             kept prefix is prefilled again, under whatever weights the engine then has
  keep       requests to `total` tokens, paused in keep mode once every one has `cut` tokens, resumed at once:
             nothing is prefilled again, but a request's tokens before the pause are as many as the engine's
             timing gave it (reported: how far past `cut` they ran), and its KV cache was computed by the weights it
             was sampled with
No weights are pushed in between (the push costs the same in both; what differs is what continuing costs). The arms
run in a rotating order, `repeats` times each; prints the fastest and the median timing of each side by side;
nothing here asserts speed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time


async def collect(engine, requests, params, tag):
    """Run the requests to their end; the token ids of each."""
    from vllm.inputs import TokensPrompt

    async def one(i, ids, sp):
        out = None
        async for out in engine.generate(TokensPrompt(prompt_token_ids=ids), sp, request_id=f"{tag}-{i}"):
            pass
        return list(out.outputs[0].token_ids)

    return await asyncio.gather(*(one(i, ids, sp) for i, (ids, sp) in enumerate(zip(requests, params))))


async def keep_mode(engine, prompts, params, cut, tag):
    """Requests to the end, paused in keep mode when every one has `cut` tokens, then resumed: (tokens, the tokens
    each had when the pause took effect)."""
    from vllm.inputs import TokensPrompt

    progress = [0] * len(prompts)
    reached = asyncio.Event()

    async def one(i, ids):
        out = None
        async for out in engine.generate(TokensPrompt(prompt_token_ids=ids), params[i], request_id=f"{tag}-{i}"):
            progress[i] = len(out.outputs[0].token_ids)
            if min(progress) >= cut:
                reached.set()
        return list(out.outputs[0].token_ids)

    tasks = [asyncio.create_task(one(i, ids)) for i, ids in enumerate(prompts)]
    await reached.wait()
    await engine.pause_generation(mode="keep", clear_cache=False)
    at_pause = list(progress)
    await engine.resume_generation()
    return await asyncio.gather(*tasks), at_pause


async def main_async(args) -> None:
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from evenrl.testing import make_tiny_model

    tmp = tempfile.mkdtemp(prefix="evenrl-partial-vllm-")
    path = make_tiny_model(os.path.join(tmp, "model"), hidden=args.hidden, layers=args.layers,
                           heads=args.hidden // 64, seed=0, max_positions=2048)
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=path, tokenizer=path, dtype="float32", enforce_eager=True, max_model_len=16 + args.total + 8,
        kv_cache_memory_bytes=1 << 30, seed=0,
        # as evenrl's engine on CPU: a seeded request's prefill split over steps kills vLLM 0.32's CPU backend
        enable_chunked_prefill=False, max_num_batched_tokens=4096))
    prompts = [[3 + (i * 7 + j) % 40 for j in range(16)] for i in range(args.requests)]

    def sp(n, seed):
        return SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, temperature=1.0, seed=seed,
                              detokenize=False)

    async def whole(tag):
        await collect(engine, prompts, [sp(args.total, i) for i in range(len(prompts))], tag)

    async def reprefill(tag):
        heads = await collect(engine, prompts, [sp(args.cut, i) for i in range(len(prompts))], tag + "a")
        await collect(engine, [p + h for p, h in zip(prompts, heads)],
                      [sp(args.total - args.cut, 1000 + i) for i in range(len(prompts))], tag + "b")

    async def keep(tag):
        _, at_pause = await keep_mode(engine, prompts, [sp(args.total, i) for i in range(len(prompts))], args.cut,
                                      tag)
        past.extend(n - args.cut for n in at_pause)

    arms = {"whole": whole, "re-prefill": reprefill, "keep": keep}
    times, past = {name: [] for name in arms}, []
    await whole("warm-up")
    for rep in range(args.repeats):  # arms in a rotating order: a machine's drifting load hits each alike
        names = list(arms)[rep % 3:] + list(arms)[:rep % 3]
        for name in names:
            t0 = time.perf_counter()
            await arms[name](f"{name}{rep}")
            times[name].append(time.perf_counter() - t0)
    engine.shutdown()
    del engine  # while the interpreter is whole: AsyncLLM's __del__ shuts down again
    import torch

    print(f"vLLM {__import__('vllm').__version__} (CPU build) AsyncLLM, random Qwen2 hidden {args.hidden} x "
          f"{args.layers} layers, fp32, {args.requests} requests x {args.total} tokens (prompt 16), cut at "
          f"{args.cut}; {os.cpu_count()} cores, torch {torch.__version__}; {args.repeats} repeats")
    # the fastest repeat is the one least disturbed by other jobs on a shared machine; the median beside it
    best, mid = min(times["whole"]), statistics.median(times["whole"])
    print(f"{'':>12} {'fastest s':>9} {'vs whole':>9} {'median s':>9} {'vs whole':>9}   (each repeat)")
    for name, ts in times.items():
        print(f"{name:>12} {min(ts):9.3f} {min(ts) / best:8.2f}x {statistics.median(ts):9.3f} "
              f"{statistics.median(ts) / mid:8.2f}x   " + " ".join(f"{t:.2f}" for t in ts))
    print(f"keep mode: requests had {min(past)}..{max(past)} tokens past the cut when the pause took effect "
          f"(median {statistics.median(past)}): where a weight push would fall depends on timing")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--cut", type=int, default=128)
    ap.add_argument("--total", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=6)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
