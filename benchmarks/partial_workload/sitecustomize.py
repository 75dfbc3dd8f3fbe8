"""benchmarks/partial_rollouts.py's workload, installed in the `evenrl train` processes it starts (this directory on
PYTHONPATH; evenrl's own code has no hook for it): response lengths drawn from a lognormal distribution instead of
the model's EOS, so a step's samples have reasoning RL's long tail, and a record of each generate call.

  EVENRL_BENCH_LENGTHS=MEDIAN:SIGMA:SEED   each sample's length is a lognormal draw keyed by (seed, the step that
                                           drew its prompt, the prompt's position, the sample), cut at the call's
                                           max_new_tokens; a sample ends (finished) at it, never earlier (EOS off)
  EVENRL_BENCH_RECORD=DIR                  each process appends one JSON line per generate call to DIR/gen-<rank>:
                                           its wall time, rows, tokens made and longest row

The length is the sample's whatever the layout and however it is cut: a continued sample (partial rollouts) gets
its own length minus the tokens it has. The wrapped HFEngine.generate samples every (prompt, sample) as a row of its
own (no shared prefill; the prompts are a few tokens).
"""

import hashlib
import importlib.abc
import importlib.util
import json
import math
import os
import sys
import time


def _length(seed, step, key, sample, median, sigma, cap):
    text = f"bench-length/{seed}/{step}/{key}/{sample}".encode()
    u = (int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") + 0.5) / 2.0**64
    z = math.sqrt(2) * _erfinv(2 * u - 1)
    return max(1, min(cap, round(median * math.exp(sigma * z))))


def _erfinv(y):  # Giles' single-precision approximation, enough for a workload
    w = -math.log((1.0 - y) * (1.0 + y))
    if w < 5.0:
        w -= 2.5
        p = 2.81022636e-08
        for c in (3.43273939e-07, -3.5233877e-06, -4.39150654e-06, 0.00021858087, -0.00125372503, -0.00417768164,
                  0.246640727, 1.50140941):
            p = c + p * w
    else:
        w = math.sqrt(w) - 3.0
        p = -0.000200214257
        for c in (0.000100950558, 0.00134934322, -0.00367342844, 0.00573950773, -0.0076224613, 0.00943887047,
                  1.00167406, 2.83297682):
            p = c + p * w
    return p * y


def _wrap(generate):
    median, sigma, seed = os.environ["EVENRL_BENCH_LENGTHS"].split(":")
    median, sigma, seed = float(median), float(sigma), int(seed)
    record = os.environ.get("EVENRL_BENCH_RECORD")

    def lognormal_lengths(self, requests, params):
        from dataclasses import replace

        rows = [(i, s) for i, r in enumerate(requests) for s in r.sample_range(params)]
        ends = [_length(seed, requests[i].step, requests[i].key, s, median, sigma, params.max_new_tokens)
                for i, s in rows]
        eos, self.eos_ids = self.eos_ids, set()  # lengths come from the draw, not the model
        t0 = time.perf_counter()
        try:
            out = generate(self, [replace(requests[i], samples=range(s, s + 1), max_tokens=max(
                1, min(requests[i].cap(params), L - requests[i].first_token))) for (i, s), L in zip(rows, ends)],
                           params)
        finally:
            self.eos_ids = eos
        result = [[] for _ in requests]
        for (i, _), L, [c] in zip(rows, ends, out):
            c.finished = requests[i].first_token + len(c.token_ids) >= L
            result[i].append(c)
        if record:
            made = [len(c.token_ids) for r in out for c in r]
            with open(os.path.join(record, f"gen-{os.environ.get('RANK', '0')}"), "a") as f:
                f.write(json.dumps({"s": time.perf_counter() - t0, "t": time.time(), "rows": len(made),
                                    "tokens": sum(made), "longest": max(made, default=0)}) + "\n")
        return result
    return lognormal_lengths


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "evenrl.engines.hf":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        sys.meta_path.insert(0, self)
        loader = spec.loader

        class Loader(importlib.abc.Loader):
            def create_module(self, spec):
                return loader.create_module(spec)

            def exec_module(self, module):
                loader.exec_module(module)
                module.HFEngine.generate = _wrap(module.HFEngine.generate)

        spec.loader = Loader()
        return spec


if os.environ.get("EVENRL_BENCH_LENGTHS"):
    sys.meta_path.insert(0, _Finder())
