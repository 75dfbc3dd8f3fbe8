"""KV-cached sampling for Hugging Face causal LMs, reproducible however prompts are batched.

Every random draw is a pure function of (seed, step, prompt key, sample index, token index), so a
completion is the same whether its prompt is generated alone, in a batch, or on another rank.
Benchmark: `python benchmarks/sampler.py` prints tokens/s on a tiny random model.
"""

from __future__ import annotations

from dataclasses import replace
from typing import get_args

import numpy as np
import torch

from evenrl.config.schema import Decoder
from evenrl.distributed.tensor_parallel import is_tensor_parallel
from evenrl.distributed.weights import gathered, sharded_modules
from evenrl.engines.base import Completion, Request, SamplingParams, row_seed
from evenrl.errors import bad
from evenrl.models.decode_graph import DecodeStep
from evenrl.models.decoder import LeanDecoder
from evenrl.models.forward_decoder import ForwardDecoder
from evenrl.models import routing
from evenrl.models.loading import autocast


# ---------------------------------------------------------------- keyed randomness

_GOLDEN = 0x9E3779B97F4A7C15


def uniforms(seeds: np.ndarray, t: int, offsets: np.ndarray | None = None) -> np.ndarray:
    """The uniform in [0, 1) that picks token `t` of each stream (splitmix64 of seed + t·golden), or token
    t + offsets[i] of stream i: a continued sample's draws go on where its earlier ones stopped."""
    if offsets is None:
        z = seeds.astype(np.uint64) + np.uint64(((t + 1) * _GOLDEN) & 0xFFFFFFFFFFFFFFFF)
    else:  # uint64 arrays wrap modulo 2^64, as the mask above does for one Python integer
        z = seeds.astype(np.uint64) + (offsets.astype(np.uint64) + np.uint64(t + 1)) * np.uint64(_GOLDEN)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) * (2.0**-53)


# ---------------------------------------------------------------- one sampling step

# Rows per float64 softmax: the whole batch for small vocabularies (one set of ops per token instead of one per
# 64 rows), ~64 rows for 150k-token ones (bounds memory at 64 MB).
_SAMPLE_CHUNK_ELEMS = 1 << 23


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
    chunk = max(1, _SAMPLE_CHUNK_ELEMS // logits.shape[-1])
    for start in range(0, logits.shape[0], chunk):
        # float64 so the CDF stays exact enough over large vocabularies. x / 1.0 == x, so T = 1 skips the division.
        x = logits[start : start + chunk]
        if temperature == 1.0:
            logp = torch.log_softmax(x, -1, dtype=torch.float64)
        else:
            logp = torch.log_softmax(x.double() / temperature, -1)
        uu = u[start : start + chunk].to(device=logp.device, dtype=torch.float64)
        probs = logp.exp()
        if top_p < 1.0:
            sp, order = probs.sort(dim=-1, descending=True, stable=True)
            cdf = sp.cumsum(-1)
            n_keep = ((cdf - sp) < top_p).sum(-1, keepdim=True).clamp(min=1)  # smallest set with mass >= top_p
            total = cdf.gather(-1, n_keep - 1)
            pos = torch.searchsorted(cdf, uu[:, None] * total, right=True)
            pos = torch.minimum(pos, n_keep - 1)
            tok = order.gather(-1, pos)
        else:
            cdf = probs.cumsum(-1)
            pos = torch.searchsorted(cdf, uu[:, None] * cdf[:, -1:], right=True)
            tok = pos.clamp_(max=probs.shape[-1] - 1)
        toks.append(tok.squeeze(-1))
        lps.append(logp.gather(-1, tok).squeeze(-1).float())
    if len(toks) == 1:
        return toks[0], lps[0]
    return torch.cat(toks), torch.cat(lps)


# ---------------------------------------------------------------- the engine

# Finished rows are dropped from the batch once this share of it has finished; until then they are computed for
# nothing. A drop only moves the live rows that sit past the new end into the finished rows' slots
# (LeanDecoder.select_rows): a few dozen small ops, so dropping early pays. 256 rows x 128 tokens with EOS, 1 thread:
# 0.02-0.05 ~10% faster than 0.25 (0.1 in between).
_COMPACT_DEAD_SHARE = 0.05

DECODERS = get_args(Decoder)


# inference_mode, not no_grad: no version counters or view tracking, ~7% faster sampling here (32 rows x 16 tokens
# and 256 x 128, same samples); nothing made here reaches autograd (completions leave as Python lists).
@torch.inference_mode()
def generate(model, requests: list[Request], params: SamplingParams, *, eos_token_ids: set[int], pad_token_id: int,
             max_batch_prompts: int | None = None, decoder: str = "auto", record_routes: bool = False,
             cache: dict | None = None) -> list[list[Completion]]:
    """Each request's samples (engines.base.Request: its prompt, key, step, sample indices, turn, continuation and
    budget); returns [request][sample]. A sample is the same whichever call, batch or rank it is made in.

    `max_batch_prompts` bounds how many prompts share one forward pass; it changes speed and memory, never the samples.
    `decoder` changes speed, not samples: "lean" (Qwen2/Llama-style models: their own modules on a KV cache
    allocated once, see LeanDecoder), "static" (lean at fixed shapes, each step replayed from a CUDA graph on CUDA,
    see models.decode_graph), "forward" (the model's Hugging Face forward with a DynamicCache: any causal LM), or
    "auto" (static on CUDA and lean elsewhere when the model supports them, else forward).
    Requests with images prefill with their pixels and the model's multimodal positions (the forward decoder).
    `record_routes`: a mixture of experts' completions carry the experts each of their tokens went to (routes: the
    prompt's in its prefill, each sampled token's when it was fed; evenrl.models.routing).
    `cache`: where LeanDecoder keeps its fused weights between calls (HFEngine's; see LeanDecoder).
    Continuing samples (partial rollouts, evenrl.rollout.carry): a request's prompt is the sample's prompt + its tokens
    so far (prefilled again), its step the step that drew it, its first_token how many tokens its stream has drawn
    (its next draw is that position's uniform: cut and continued under unchanged weights, a sample is the one never
    cut) and its max_tokens its most new tokens in this call.
    """
    ranges = [r.sample_range(params) for r in requests]
    for r in requests:
        r.cap(params)  # checked before any forward
        if len(r.prompt) == 0:
            raise ValueError(f"generate: prompt with key {r.key} has no tokens")
    streams = [(r.step, r.key, s, r.turn) for r, samples in zip(requests, ranges) for s in samples]
    if len(set(streams)) != len(streams):
        raise ValueError("generate: (step, prompt key, sample) must be unique within a call (equal keys give equal "
                         "samples)")
    if decoder not in DECODERS:
        raise bad("decoder", decoder, f"one of {', '.join(DECODERS)}")
    if decoder in ("lean", "static") and not LeanDecoder.supports(model):
        raise bad("decoder", decoder, f"forward or auto for {type(model).__name__} "
                                      f"({decoder} covers {', '.join(LeanDecoder.ARCHS)})")
    if not requests:
        return []
    if any(r.images is not None for r in requests):  # the vision tower and multimodal positions: the model's forward
        decoder = "forward"
    elif decoder == "auto":
        decoder = _auto_decoder(model)
    chunk = max_batch_prompts or len(requests)
    # continued samples apart from new prompts: left padding makes every row pay for the longest (676 ms -> 192 ms)
    groups = [[i for i, r in enumerate(requests) if r.first_token == 0],
              [i for i, r in enumerate(requests) if r.first_token > 0]]
    was_training = model.training
    model.eval()  # dropout off: a sample must not depend on anything but its key
    try:
        out: list[list[Completion] | None] = [None] * len(requests)
        with autocast(model):  # mixed precision of a replicated model (models.loading.set_autocast)
            for group in groups:
                for s in range(0, len(group), chunk):
                    rows = group[s:s + chunk]
                    # every forward here runs with no training plan on the routers: recording, or passing through
                    with routing.recording(model, record_routes) as recorder:
                        made = _generate_batch(model, [requests[i] for i in rows], params, set(eos_token_ids),
                                               pad_token_id, decoder, recorder, cache)
                    for i, samples in zip(rows, made):
                        out[i] = samples
        return out
    finally:
        model.train(was_training)


def _auto_decoder(model) -> str:
    """static on CUDA, lean elsewhere, forward for models LeanDecoder does not cover. Measured on one H200
    (benchmarks/results/gpu-suite-2026-11-27-sampler.md, 0.5B shape, 64 rows x 128 tokens): static 10.8 k tokens/s
    fp32 and 17.1 k bf16 against lean's 6.8 k and 4.4 k (lean is launch-bound: the GPU is busy 17-29 % of the time,
    the graph replay 72-81 %). On CPU static runs eagerly and is no faster than lean, which drops finished rows."""
    if not LeanDecoder.supports(model):
        return "forward"
    return "static" if next(model.parameters()).device.type == "cuda" else "lean"


def _generate_batch(model, reqs: list[Request], params: SamplingParams, eos_ids, pad_token_id, decoder: str,
                    recorder, cache: dict | None = None):
    prompts, caps = [r.prompt for r in reqs], [r.cap(params) for r in reqs]
    ranges = [r.sample_range(params) for r in reqs]
    device = next(model.parameters()).device
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

    max_new = max(caps)
    if decoder == "forward":
        dec = ForwardDecoder(model)
    else:
        dec = LeanDecoder(model, width + max_new, static=decoder == "static", cache=cache)
    shift = [0] * n_prompts  # multimodal positions: a next token's position beyond the prompt's length
    if all(r.images is None for r in reqs):
        logits = dec.prefill(input_ids, attn, position_ids)
    else:
        logits, shift = dec.prefill_images(input_ids, attn, [r.images for r in reqs])
    prefill_routes = None if recorder is None else recorder.take().unflatten(0, (n_prompts, width))
    # batch row -> (prompt, sample index)
    row_of = [(i, s) for i, samples in enumerate(ranges) for s in samples]
    n_rows = len(row_of)
    if n_rows > n_prompts:  # the samples of a prompt share its prefill: its row is copied to each of them
        index = torch.tensor([i for i, _ in row_of], device=device)
        dec.repeat_rows(index)
        logits = logits.index_select(0, index)
    seeds = np.array([row_seed(params.seed, reqs[i].step, reqs[i].key, s, reqs[i].turn) for i, s in row_of],
                     dtype=np.uint64)
    # a continued sample's draws start at its first new token's position; the rows of one call stop at their caps
    first = [r.first_token for r in reqs]
    offsets = np.array([first[i] for i, _ in row_of], dtype=np.uint64) if any(first) else None
    row_caps = np.array([caps[i] for i, _ in row_of]) if min(caps) < max_new else None
    next_pos = torch.tensor([lens[i] + shift[i] for i, _ in row_of], device=device)
    # EOS test as one lookup in a vocabulary-sized table (ids outside the vocabulary are never sampled).
    vocab = logits.shape[-1]
    eos_in_vocab = sorted(e for e in eos_ids if 0 <= e < vocab)
    is_eos = None
    if eos_in_vocab:
        is_eos = torch.zeros(vocab, dtype=torch.bool, device=device)
        is_eos[eos_in_vocab] = True
    decode = _decode_static if decoder == "static" else _decode_shrinking
    fed = [] if recorder is not None else None  # per decoding step: (global rows fed, their routes)
    params = replace(params, max_new_tokens=max_new)
    toks, lps, lens_out = decode(dec, logits, seeds, next_pos, is_eos, params, offsets, row_caps,
                                 **({} if fed is None else {"on_step": lambda rows: fed.append((rows, recorder.take()))}))
    routes = None if fed is None else _routes(prefill_routes, fed, [(i, lens[i]) for i, _ in row_of], lens_out)
    eos_set = set(eos_in_vocab)
    out: list[list[Completion]] = [[] for _ in range(n_prompts)]
    for r, (i, s) in enumerate(row_of):
        m = lens_out[r]
        out[i].append(Completion(reqs[i].key, s, toks[r][:m], lps[r][:m], toks[r][m - 1] in eos_set,
                                 None if routes is None else routes[r]))
    return out


def _routes(prefill, fed, prompt_of_row, lengths) -> list[torch.Tensor]:
    """Each row's routes: its prompt's from the prefill (prefill [prompts, width, L, k], left-padded), then those of
    its first length - 1 sampled tokens, in the order the decoding steps fed them (`fed`: per step the global rows of
    its batch and their routes [rows, L, k]; a finished row fed until it was dropped has more, ignored)."""
    width = prefill.shape[1]
    rows = np.concatenate([r for r, _ in fed]) if fed else np.zeros(0, dtype=np.int64)
    ids = torch.cat([x for _, x in fed]) if fed else prefill.new_zeros((0, *prefill.shape[2:]))
    order = np.argsort(rows, kind="stable")  # each row's steps in time order
    starts = np.searchsorted(rows[order], np.arange(len(lengths)))
    return [torch.cat([prefill[i, width - n:], ids[torch.from_numpy(order[a:a + m - 1])]])
            for (i, n), a, m in zip(prompt_of_row, starts, lengths)]


def _decode_shrinking(dec, logits, seeds, next_pos, is_eos, params: SamplingParams, offsets=None, caps=None,
                      on_step=None):
    """Samples max_new_tokens steps, dropping finished rows as it goes; returns per row its tokens, log-probs
    (lists, max_new_tokens long, padded) and length (through its EOS). `offsets`: per row, the position in its
    stream of its first token (None: 0); `caps`: per row, its most tokens (None: max_new_tokens). on_step(rows):
    called after each decoding step with the global row of each of its batch rows."""
    device, n_rows, max_new = logits.device, len(seeds), params.max_new_tokens
    # Per-token bookkeeping stays in numpy/Python and the sampled tokens are written out once at the end: each torch
    # op costs microseconds on CPU, where a 32-row step is only ~3 ms.
    rows = np.arange(n_rows)  # global row of each batch row
    live = np.ones(n_rows, dtype=bool)  # batch rows still generating (finished ones wait to be dropped)
    n_dead = 0
    live_idx = None  # (numpy, device) indices of the live batch rows; None while all are live
    record = []  # per step: (global rows sampled, tokens, log-probs)
    tok_in = None
    for t in range(max_new):
        g = rows if live_idx is None else rows[live_idx[0]]  # global rows sampled at this step
        u = torch.from_numpy(uniforms(seeds[g], t, None if offsets is None else offsets[g]))
        tok, lp = sample_from_logits(logits if live_idx is None else logits.index_select(0, live_idx[1]), u,
                                     params.temperature, params.top_p)
        record.append((g, tok, lp))
        if t == max_new - 1:
            break
        if is_eos is not None or caps is not None:
            done = is_eos[tok].cpu().numpy() if is_eos is not None else np.zeros(len(g), dtype=bool)
            if caps is not None:  # a row at its cap is done as if it had ended
                done = done | (caps[g] <= t + 1)
            n_done = int(done.sum())
            if n_done == len(g):
                break
            if n_done:
                live[np.flatnonzero(live)[done]] = False
                n_dead += n_done
        # Finished rows keep their last input token; they are computed but never sampled until dropped.
        tok_in = tok if live_idx is None else tok_in.index_put((live_idx[1],), tok)
        if n_dead >= max(1, _COMPACT_DEAD_SHARE * len(live)):  # drop finished rows, keep live ones
            # The live rows past the first n_live slots fill the finished rows' slots: few rows move in the cache.
            live_rows = np.flatnonzero(live)
            keep = np.arange(len(live_rows))
            keep[~live[: len(keep)]] = live_rows[live_rows >= len(keep)]
            keep_d = torch.from_numpy(keep).to(device)
            dec.select_rows(keep_d)
            rows, tok_in, next_pos = rows[keep], tok_in[keep_d], next_pos[keep_d]
            live, n_dead = np.ones(len(keep), dtype=bool), 0
        if n_dead:
            li = np.flatnonzero(live)
            live_idx = (li, torch.from_numpy(li).to(device))
        else:
            live_idx = None
        logits = dec.step(tok_in, next_pos)
        if on_step is not None:
            on_step(rows)
        next_pos = next_pos + 1

    # One scatter for the whole generation: record[t] holds the tokens of the rows sampled at step t.
    g_all = np.concatenate([g for g, _, _ in record])
    t_all = np.repeat(np.arange(len(record)), [len(g) for g, _, _ in record])
    out_tok = torch.full((n_rows, max_new), -1, dtype=torch.long)
    out_lp = torch.zeros((n_rows, max_new), dtype=torch.float32)
    where = (torch.from_numpy(g_all), torch.from_numpy(t_all))
    out_tok.index_put_(where, torch.cat([tok for _, tok, _ in record]).cpu())
    out_lp.index_put_(where, torch.cat([lp for _, _, lp in record]).cpu())
    lens_out = np.bincount(g_all, minlength=n_rows).tolist()  # a row is sampled at steps 0..length-1
    return out_tok.tolist(), out_lp.tolist(), lens_out


# The static decoder asks the device whether every row has finished once per this many tokens: each question waits
# for the queued steps (and breaks the stream of replayed graphs); finished rows only cost compute meanwhile.
_EOS_CHECK_EVERY = 8


def _decode_static(dec, logits, seeds, next_pos, is_eos, params: SamplingParams, offsets=None, caps=None):
    """_decode_shrinking's samples at fixed shapes: every row stays in the batch to the end (or until all have
    finished), tokens and log-probs are written into device tensors, the generation's uniforms go to the device in
    one copy, and each step goes through DecodeStep (a replayed CUDA graph on CUDA). `offsets`, `caps` as there."""
    device, n_rows, max_new = logits.device, len(seeds), params.max_new_tokens
    u_all = torch.from_numpy(np.stack([uniforms(seeds, t, offsets) for t in range(max_new)], axis=1)).to(device)
    toks = torch.zeros((n_rows, max_new), dtype=torch.long, device=device)
    lps = torch.zeros((n_rows, max_new), dtype=torch.float32, device=device)
    cap_d = None if caps is None else torch.from_numpy(caps).to(device)
    done = None if is_eos is None and caps is None else torch.zeros(n_rows, dtype=torch.bool, device=device)
    step = DecodeStep(dec, next_pos)
    n = max_new
    for t in range(max_new):
        tok, lp = sample_from_logits(logits, u_all[:, t], params.temperature, params.top_p)
        toks[:, t], lps[:, t] = tok, lp
        if t == max_new - 1:
            break
        if done is not None:
            if is_eos is not None:
                done |= is_eos[tok]
            if cap_d is not None:
                done |= cap_d <= t + 1
            if (t + 1) % _EOS_CHECK_EVERY == 0 and bool(done.all()):
                n = t + 1
                break
        logits = step(tok)
    toks, lps = toks[:, :n], lps[:, :n]
    lens_out = [n] * n_rows
    if is_eos is not None:  # a row ends at its first EOS
        hit = is_eos[toks]
        lens_out = torch.where(hit.any(1), hit.int().argmax(1) + 1, n).tolist()
    if caps is not None:  # or at its cap (what it drew past it is dropped)
        lens_out = np.minimum(lens_out, caps).tolist()
    return toks.cpu().tolist(), lps.cpu().tolist(), lens_out


def greedy(model, prompts: list[list[int]], *, max_new_tokens: int, eos_token_ids: set[int], pad_token_id: int,
           max_batch_prompts: int | None = None, images: list | None = None) -> list[Completion]:
    """Greedy decoding for evaluation: one completion per prompt, in prompt order."""
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    requests = [Request(p, i, 0, images=None if images is None else images[i]) for i, p in enumerate(prompts)]
    res = generate(model, requests, params, eos_token_ids=eos_token_ids, pad_token_id=pad_token_id,
                   max_batch_prompts=max_batch_prompts)
    return [r[0] for r in res]


class HFEngine:
    """evenrl's sampler on a model in this process. Colocated it is the training model itself: nothing to push and
    nothing to free. On a reserved rollout rank it is that rank's own copy, which update_weights overwrites."""

    name = "hf"
    needs_weights = False

    def __init__(self, model, *, eos_token_ids: set[int], pad_token_id: int, decoder: str = "auto",
                 record_routes: bool = False):
        self.model, self.eos_ids, self.pad_id, self.decoder = model, set(eos_token_ids), pad_token_id, decoder
        # rollout.router_replay=engine; a tensor-parallel model's tp group calls with the same requests, in lockstep
        self.record_routes, self.lockstep = record_routes, "tp" if is_tensor_parallel(model) else None
        # the decoder's fused weights from one call to the next while the weights are unchanged, until sleep() (the
        # end of a rollout: the update gets the memory back); not for FSDP2, whose gathered weights are new tensors
        self.fused: dict = {}

    def generate(self, requests: list[Request], params: SamplingParams) -> list[list[Completion]]:
        # every rank enters gathered() even with no requests: with FSDP2 it is an all-gather all ranks must join
        with gathered(self.model):
            if not requests:
                return []
            return generate(self.model, requests, params, eos_token_ids=self.eos_ids, pad_token_id=self.pad_id,
                            decoder=self.decoder, record_routes=self.record_routes,
                            cache=None if sharded_modules(self.model) else self.fused)

    def update_weights(self, buckets) -> None:
        state = self.model.state_dict(keep_vars=True)
        with torch.no_grad():
            for name, t in (pair for bucket in buckets for pair in bucket):
                state[name].copy_(t)

    def sleep(self) -> None:
        self.fused.clear()

    def wake(self) -> None:
        return None
