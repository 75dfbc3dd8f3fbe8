"""KV-cached sampling for Hugging Face causal LMs, reproducible however prompts are batched.

Every random draw is a pure function of (seed, step, prompt key, sample index, token index), so a
completion is the same whether its prompt is generated alone, in a batch, or on another rank.
Benchmark: `python -m evenrl.rollout` prints tokens/s on a tiny random model.
"""

from __future__ import annotations

import hashlib
import inspect
import math
from dataclasses import dataclass

import numpy as np
import torch

from evenrl.errors import bad


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    samples_per_prompt: int = 1
    seed: int = 0

    def __post_init__(self):
        if not (isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1):
            raise bad("max_new_tokens", self.max_new_tokens, "an integer >= 1")
        if not (isinstance(self.samples_per_prompt, int) and self.samples_per_prompt >= 1):
            raise bad("samples_per_prompt", self.samples_per_prompt, "an integer >= 1")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise bad("temperature", self.temperature, "a number >= 0 (0 means greedy)")
        if not (0 < self.top_p <= 1):
            raise bad("top_p", self.top_p, "a number in (0, 1]")


@dataclass
class Completion:
    prompt_key: int
    sample_index: int
    token_ids: list[int]  # generated tokens only; ends with the EOS token when finished
    logprobs: list[float]  # one per token in token_ids
    finished: bool  # stopped at EOS (False: hit max_new_tokens)


# ---------------------------------------------------------------- keyed randomness

_GOLDEN = 0x9E3779B97F4A7C15


def row_seed(seed: int, step: int, key: int, sample_index: int) -> int:
    """64-bit seed of one (prompt, sample) stream; stable across processes and Python versions."""
    text = f"evenrl-rollout/{int(seed)}/{int(step)}/{int(key)}/{int(sample_index)}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")


def uniforms(seeds: np.ndarray, t: int) -> np.ndarray:
    """The uniform in [0, 1) that picks token `t` of each stream (splitmix64 of seed + t·golden)."""
    z = seeds.astype(np.uint64) + np.uint64(((t + 1) * _GOLDEN) & 0xFFFFFFFFFFFFFFFF)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) * (2.0**-53)


# ---------------------------------------------------------------- one sampling step

_SAMPLE_CHUNK = 64  # rows per float64 softmax; bounds memory for 150k-token vocabularies


def sample_from_logits(logits: torch.Tensor, u: torch.Tensor, temperature: float, top_p: float):
    """Pick one token per row by inverse-CDF sampling with the given uniforms.

    Returns (tokens [R] long, logprobs [R] float32). The log-prob is under softmax(logits / T) over
    the full vocabulary (before top-p), i.e. what a trainer's forward pass computes. Temperature 0
    is argmax (first index on ties) and reports log-probs under softmax(logits).
    """
    if temperature == 0:
        tokens = logits.argmax(-1)
        lp = torch.log_softmax(logits.float(), -1).gather(-1, tokens[:, None]).squeeze(-1)
        return tokens, lp
    toks, lps = [], []
    for start in range(0, logits.shape[0], _SAMPLE_CHUNK):
        # float64 so the CDF stays exact enough over large vocabularies.
        logp = torch.log_softmax(logits[start : start + _SAMPLE_CHUNK].double() / temperature, -1)
        uu = u[start : start + _SAMPLE_CHUNK].to(device=logp.device, dtype=torch.float64)
        probs = logp.exp()
        if top_p < 1.0:
            sp, order = probs.sort(dim=-1, descending=True, stable=True)
            cdf = sp.cumsum(-1)
            n_keep = ((cdf - sp) < top_p).sum(-1, keepdim=True).clamp(min=1)  # smallest set with mass >= top_p
            total = cdf.gather(-1, n_keep - 1)
            pos = torch.searchsorted(cdf, uu[:, None] * total, right=True)
            pos = torch.minimum(pos, n_keep - 1)
            tok = order.gather(-1, pos).squeeze(-1)
        else:
            cdf = probs.cumsum(-1)
            pos = torch.searchsorted(cdf, uu[:, None] * cdf[:, -1:], right=True)
            tok = pos.clamp(max=probs.shape[-1] - 1).squeeze(-1)
        toks.append(tok)
        lps.append(logp.gather(-1, tok[:, None]).squeeze(-1).float())
    return torch.cat(toks), torch.cat(lps)


# ---------------------------------------------------------------- the engine

_KEEP_ARG: dict[type, bool] = {}


def _supports_logits_to_keep(model) -> bool:
    cls = type(model)
    if cls not in _KEEP_ARG:
        _KEEP_ARG[cls] = "logits_to_keep" in inspect.signature(cls.forward).parameters
    return _KEEP_ARG[cls]


def _new_cache(model):
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)
    except TypeError:  # transformers < 4.56 has no config argument
        return DynamicCache()


@torch.no_grad()
def generate(
    model,
    prompts: list[list[int]],
    keys: list[int],
    params: SamplingParams,
    *,
    step: int,
    eos_token_ids: set[int],
    pad_token_id: int,
    max_batch_prompts: int | None = None,
) -> list[list[Completion]]:
    """Sample `params.samples_per_prompt` completions per prompt; returns [prompt][sample].

    `keys` name the prompts' random streams and must be unique within a step; use something that
    does not depend on the rank layout, e.g. the prompt's position in the global batch (not its
    dataset row, which can repeat across an epoch boundary). `max_batch_prompts` bounds how many
    prompts share one forward pass; it changes speed and memory, never the samples.
    """
    if len(keys) != len(prompts):
        raise ValueError(f"generate: {len(prompts)} prompts but {len(keys)} keys")
    if len(set(keys)) != len(keys):
        raise ValueError("generate: prompt keys must be unique within a step (equal keys give equal samples)")
    for k, p in zip(keys, prompts):
        if len(p) == 0:
            raise ValueError(f"generate: prompt with key {k} has no tokens")
    if not prompts:
        return []
    chunk = max_batch_prompts or len(prompts)
    was_training = model.training
    model.eval()  # dropout off: a sample must not depend on anything but its key
    try:
        out: list[list[Completion]] = []
        for s in range(0, len(prompts), chunk):
            out.extend(
                _generate_batch(model, prompts[s : s + chunk], keys[s : s + chunk], params, step,
                                set(eos_token_ids), pad_token_id)
            )
        return out
    finally:
        model.train(was_training)


def _generate_batch(model, prompts, keys, params: SamplingParams, step, eos_ids, pad_token_id):
    device = next(model.parameters()).device
    n = params.samples_per_prompt
    n_prompts = len(prompts)
    lens = [len(p) for p in prompts]
    width = max(lens)

    # Left padding: every prompt's last token sits in the last column, so one step's logits are [:, -1].
    input_ids = torch.full((n_prompts, width), pad_token_id, dtype=torch.long)
    attn = torch.zeros((n_prompts, width), dtype=torch.long)
    for i, p in enumerate(prompts):
        input_ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        attn[i, width - len(p) :] = 1
    position_ids = (attn.cumsum(-1) - 1).clamp(min=0)
    input_ids, attn, position_ids = input_ids.to(device), attn.to(device), position_ids.to(device)

    cache = _new_cache(model)
    extra = {"logits_to_keep": 1} if _supports_logits_to_keep(model) else {}
    out = model(input_ids=input_ids, attention_mask=attn, position_ids=position_ids,
                past_key_values=cache, use_cache=True, **extra)
    cache = out.past_key_values
    logits = out.logits[:, -1, :]
    del out
    if n > 1:  # the n samples of a prompt share its prefill
        cache.batch_repeat_interleave(n)
        logits = logits.repeat_interleave(n, dim=0)
        attn = attn.repeat_interleave(n, dim=0)

    n_rows = n_prompts * n
    seeds = np.array([row_seed(params.seed, step, keys[r // n], r % n) for r in range(n_rows)], dtype=np.uint64)
    next_pos = torch.tensor(lens, device=device).repeat_interleave(n)
    active = torch.arange(n_rows)  # global row of each batch row still generating
    eos = torch.tensor(sorted(eos_ids), dtype=torch.long, device=device)
    max_new = params.max_new_tokens
    out_tok = torch.full((n_rows, max_new), -1, dtype=torch.long)
    out_lp = torch.zeros((n_rows, max_new), dtype=torch.float32)
    length = torch.zeros(n_rows, dtype=torch.long)
    finished = torch.zeros(n_rows, dtype=torch.bool)

    for t in range(max_new):
        u = torch.from_numpy(uniforms(seeds[active.numpy()], t))
        tok, lp = sample_from_logits(logits, u, params.temperature, params.top_p)
        out_tok[active, t] = tok.cpu()
        out_lp[active, t] = lp.cpu()
        length[active] = t + 1
        done = torch.isin(tok, eos) if len(eos) else torch.zeros_like(tok, dtype=torch.bool)
        finished[active[done.cpu()]] = True
        if t == max_new - 1 or bool(done.all()):
            break
        if bool(done.any()):  # drop finished rows so later steps only compute live ones
            keep = (~done).nonzero().squeeze(1)
            cache.batch_select_indices(keep)
            attn, tok, next_pos = attn[keep], tok[keep], next_pos[keep]
            active = active[keep.cpu()]
        attn = torch.cat([attn, attn.new_ones((attn.shape[0], 1))], dim=1)
        out = model(input_ids=tok[:, None], attention_mask=attn, position_ids=next_pos[:, None],
                    past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        logits = out.logits[:, -1, :]
        del out
        next_pos = next_pos + 1

    toks, lps, lens_out, fin = out_tok.tolist(), out_lp.tolist(), length.tolist(), finished.tolist()
    completions = [
        Completion(keys[r // n], r % n, toks[r][: lens_out[r]], lps[r][: lens_out[r]], fin[r]) for r in range(n_rows)
    ]
    return [completions[i * n : (i + 1) * n] for i in range(n_prompts)]


def greedy(model, prompts: list[list[int]], *, max_new_tokens: int, eos_token_ids: set[int], pad_token_id: int,
           max_batch_prompts: int | None = None) -> list[Completion]:
    """Greedy decoding for evaluation: one completion per prompt, in prompt order."""
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    res = generate(model, prompts, list(range(len(prompts))), params, step=0, eos_token_ids=eos_token_ids,
                   pad_token_id=pad_token_id, max_batch_prompts=max_batch_prompts)
    return [r[0] for r in res]


def _benchmark():  # pragma: no cover - prints numbers
    import tempfile
    import time

    from evenrl.models import encode_prompt, load_policy, make_tiny_model

    with tempfile.TemporaryDirectory() as d:
        model, tok = load_policy(make_tiny_model(d))
    prompts = [encode_prompt(tok, f"{i % 50}+{(7 * i) % 50}=", False) for i in range(32)]
    keys = list(range(32))
    for new in (16, 128):
        params = SamplingParams(max_new_tokens=new, samples_per_prompt=8)
        generate(model, prompts[:2], keys[:2], params, step=0, eos_token_ids=set(), pad_token_id=tok.pad_token_id)
        t0 = time.perf_counter()
        res = generate(model, prompts, keys, params, step=1, eos_token_ids=set(), pad_token_id=tok.pad_token_id)
        dt = time.perf_counter() - t0
        n_tok = sum(len(c.token_ids) for r in res for c in r)
        print(f"32 prompts x 8 samples x {new} new tokens: {n_tok} tokens in {dt:.2f} s = {n_tok / dt:,.0f} tokens/s "
              f"(torch threads: {torch.get_num_threads()})")


if __name__ == "__main__":
    _benchmark()
