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

_KEEP_ARG: dict[type, bool] = {}

# Finished rows are dropped from the batch once this share of it has finished; until then they are computed for
# nothing. A drop only moves the live rows that sit past the new end into the finished rows' slots
# (LeanDecoder.select_rows): a few dozen small ops, so dropping early pays. 256 rows x 128 tokens with EOS, 1 thread:
# 0.02-0.05 ~10% faster than 0.25 (0.1 in between).
_COMPACT_DEAD_SHARE = 0.05


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


# inference_mode, not no_grad: no version counters or view tracking, ~7% faster sampling here (32 rows x 16 tokens
# and 256 x 128, same samples); nothing made here reaches autograd (completions leave as Python lists).
@torch.inference_mode()
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
    decoder: str = "auto",
    sample_ranges: list[tuple[int, int]] | None = None,
) -> list[list[Completion]]:
    """Sample `params.samples_per_prompt` completions per prompt; returns [prompt][sample].
    `sample_ranges` [(first, count)] per prompt samples only those indices of the prompt's streams (a rank's part of
    a prompt split over ranks); a sample is the same whichever part it is generated in.

    `keys` name the prompts' random streams and must be unique within a step; use something that
    does not depend on the rank layout, e.g. the prompt's position in the global batch (not its
    dataset row, which can repeat across an epoch boundary). `max_batch_prompts` bounds how many
    prompts share one forward pass; it changes speed and memory, never the samples.
    `decoder` changes speed, not samples: "lean" (Qwen2/Llama-style models: their own modules on a KV cache
    allocated once, see LeanDecoder), "forward" (the model's Hugging Face forward with a DynamicCache: any causal
    LM), or "auto" (lean when the model supports it).
    """
    if len(keys) != len(prompts):
        raise ValueError(f"generate: {len(prompts)} prompts but {len(keys)} keys")
    if len(set(keys)) != len(keys):
        raise ValueError("generate: prompt keys must be unique within a step (equal keys give equal samples)")
    for k, p in zip(keys, prompts):
        if len(p) == 0:
            raise ValueError(f"generate: prompt with key {k} has no tokens")
    n = params.samples_per_prompt
    ranges = [(0, n)] * len(prompts) if sample_ranges is None else [(int(a), int(c)) for a, c in sample_ranges]
    if len(ranges) != len(prompts) or any(a < 0 or c < 1 or a + c > n for a, c in ranges):
        raise bad("sample_ranges", sample_ranges, f"one (first, count) per prompt with 0 <= first, count >= 1, "
                                                  f"first + count <= samples_per_prompt ({n})")
    if decoder not in ("auto", "lean", "forward"):
        raise bad("decoder", decoder, "one of auto, lean, forward")
    if decoder == "lean" and not LeanDecoder.supports(model):
        raise bad("decoder", decoder, f"forward or auto for {type(model).__name__} "
                                      f"(lean covers {', '.join(LeanDecoder.ARCHS)})")
    if not prompts:
        return []
    lean = decoder == "lean" or (decoder == "auto" and LeanDecoder.supports(model))
    chunk = max_batch_prompts or len(prompts)
    was_training = model.training
    model.eval()  # dropout off: a sample must not depend on anything but its key
    try:
        out: list[list[Completion]] = []
        for s in range(0, len(prompts), chunk):
            out.extend(
                _generate_batch(model, prompts[s : s + chunk], keys[s : s + chunk], ranges[s : s + chunk], params,
                                step, set(eos_token_ids), pad_token_id, lean)
            )
        return out
    finally:
        model.train(was_training)


def _generate_batch(model, prompts, keys, ranges, params: SamplingParams, step, eos_ids, pad_token_id, lean: bool):
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

    max_new = params.max_new_tokens
    dec = LeanDecoder(model, width + max_new) if lean else _ForwardDecoder(model)
    logits = dec.prefill(input_ids, attn, position_ids)
    # batch row -> (prompt, sample index)
    row_of = [(i, a + j) for i, (a, c) in enumerate(ranges) for j in range(c)]
    n_rows = len(row_of)
    if n_rows > n_prompts:  # the samples of a prompt share its prefill: its row is copied to each of them
        index = torch.tensor([i for i, _ in row_of], device=device)
        dec.repeat_rows(index)
        logits = logits.index_select(0, index)
    seeds = np.array([row_seed(params.seed, step, keys[i], s) for i, s in row_of], dtype=np.uint64)
    next_pos = torch.tensor([lens[i] for i, _ in row_of], device=device)
    # EOS test as one lookup in a vocabulary-sized table (ids outside the vocabulary are never sampled).
    vocab = logits.shape[-1]
    eos_in_vocab = sorted(e for e in eos_ids if 0 <= e < vocab)
    is_eos = None
    if eos_in_vocab:
        is_eos = torch.zeros(vocab, dtype=torch.bool, device=device)
        is_eos[eos_in_vocab] = True

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
        u = torch.from_numpy(uniforms(seeds[g], t))
        tok, lp = sample_from_logits(logits if live_idx is None else logits.index_select(0, live_idx[1]), u,
                                     params.temperature, params.top_p)
        record.append((g, tok, lp))
        if t == max_new - 1:
            break
        if is_eos is not None:
            done = is_eos[tok].cpu().numpy()
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
        next_pos = next_pos + 1

    # One scatter for the whole generation: record[t] holds the tokens of the rows sampled at step t.
    g_all = np.concatenate([g for g, _, _ in record])
    t_all = np.repeat(np.arange(len(record)), [len(g) for g, _, _ in record])
    out_tok = torch.full((n_rows, max_new), -1, dtype=torch.long)
    out_lp = torch.zeros((n_rows, max_new), dtype=torch.float32)
    where = (torch.from_numpy(g_all), torch.from_numpy(t_all))
    out_tok.index_put_(where, torch.cat([tok for _, tok, _ in record]).cpu())
    out_lp.index_put_(where, torch.cat([lp for _, _, lp in record]).cpu())
    toks, lps = out_tok.tolist(), out_lp.tolist()
    lens_out = np.bincount(g_all, minlength=n_rows).tolist()  # a row is sampled at steps 0..length-1
    eos_set = set(eos_in_vocab)
    out: list[list[Completion]] = [[] for _ in range(n_prompts)]
    for r, (i, s) in enumerate(row_of):
        m = lens_out[r]
        out[i].append(Completion(keys[i], s, toks[r][:m], lps[r][:m], toks[r][m - 1] in eos_set))
    return out


class _ForwardDecoder:
    """Any Hugging Face causal LM through its own forward and a DynamicCache (the reference path)."""

    def __init__(self, model):
        self.model = model
        self.cache = _new_cache(model)
        self.attn = None

    def prefill(self, input_ids, attn, position_ids):
        extra = {"logits_to_keep": 1} if _supports_logits_to_keep(self.model) else {}
        out = self.model(input_ids=input_ids, attention_mask=attn, position_ids=position_ids,
                         past_key_values=self.cache, use_cache=True, **extra)
        self.cache, self.attn = out.past_key_values, attn
        return out.logits[:, -1, :]

    def repeat_rows(self, index):
        self.cache.batch_select_indices(index)
        self.attn = self.attn[index]

    def select_rows(self, keep):
        self.cache.batch_select_indices(keep)
        self.attn = self.attn[keep]

    def step(self, tok, pos):
        self.attn = torch.cat([self.attn, self.attn.new_ones((self.attn.shape[0], 1))], dim=1)
        out = self.model(input_ids=tok[:, None], attention_mask=self.attn, position_ids=pos[:, None],
                         past_key_values=self.cache, use_cache=True)
        self.cache = out.past_key_values
        return out.logits[:, -1, :]


# Below this many keys, LeanDecoder.step computes the softmax as exp(s - max) / sum: torch.softmax's CPU kernel takes
# 90-440 us on [1024, 2, L<16] float32 rows against 25-90 us for the four ops (2 cores, AVX-512), 31 us at L = 16.
_SHORT_ROWS = 16


class LeanDecoder:
    """Incremental decoding for plain pre-norm decoder-only LMs (Qwen2, Llama): the model's weights applied layer by
    layer on a KV cache allocated once for prompt + max_new_tokens.

    Why: on CPU, Hugging Face's forward grows its cache with torch.cat at every token (and the row drops copy it),
    which was ~35% of sampling time for a 2.4 M-parameter Qwen2 at 256 rows x 128 tokens. Here a token costs the
    projections (one fused q|k|v and one fused gate|up matmul per layer) and attention over a view of the cache;
    finished rows are dropped in place (select_rows). A decoding step (step) is written for one query per row with
    few torch ops, since at 32 rows about half of a step is per-op overhead: rotary tables built once per call and q,
    k rotated together, residual adds done by the matmuls, weights pre-transposed for MKL (see _weight). Measured on
    2 cores, tiny Qwen2 (hidden 256, 4 layers): 1.3-1.45x faster than the model's forward at 32 rows x 16 tokens,
    1.4x (with EOS) to 1.6x at 256 rows x 128 tokens; 1.15-1.25x and 1.05-1.1x (1.2x with EOS) faster than this
    class before those rewrites. Attention and projections are then ~70% of a 256-row step.
    The arithmetic is the model's (same norms, rotary embedding, activation and scaling); the matmul grouping and the
    softmax of rows shorter than _SHORT_ROWS differ, which moves log-probs by float rounding (tests compare both
    decoders and the model's uncached forward).
    """

    ARCHS = ("Qwen2ForCausalLM", "LlamaForCausalLM")
    _RMS_NORMS = ("Qwen2RMSNorm", "LlamaRMSNorm")

    @classmethod
    def supports(cls, model) -> bool:
        if type(model).__name__ not in cls.ARCHS:
            return False
        cfg, inner = model.config, getattr(model, "model", None)
        if inner is None or not hasattr(inner, "rotary_emb") or getattr(cfg, "pretraining_tp", 1) != 1:
            return False
        if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or [])):
            return False  # sliding-window layers: leave them to the model's own masks
        if getattr(cfg, "use_sliding_window", False):
            return False
        if getattr(inner.rotary_emb, "rope_type", "default") in ("dynamic", "longrope"):
            return False  # their frequencies depend on each call's positions: no table built once (see __init__)
        # Sharded (DTensor) parameters are gathered by hooks on the wrapped modules' forward, which we bypass.
        return all(type(p.data) is torch.Tensor for p in model.parameters())

    def __init__(self, model, max_len: int):
        inner = model.model
        self.model, self.inner, self.max_len = model, inner, max_len
        first = inner.layers[0].self_attn
        self.head_dim = first.head_dim
        self.heads = model.config.num_attention_heads
        self.kv_heads = model.config.num_key_value_heads
        p = next(model.parameters())
        self.rope = rope_table(model, max_len)  # once per call: the model recomputes it at every token
        self.zero = torch.zeros((), dtype=p.dtype, device=p.device)
        self.layers = []
        for layer in inner.layers:  # weights change every optimizer step, so fuse per generate call
            a, m = layer.self_attn, layer.mlp
            qkv_b = None
            if a.q_proj.bias is not None:
                qkv_b = torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias])
            gu_b = torch.cat([m.gate_proj.bias, m.up_proj.bias]) if m.gate_proj.bias is not None else None
            self.layers.append((_norm(layer.input_layernorm), _weight(a.q_proj, a.k_proj, a.v_proj), qkv_b,
                                _weight(a.o_proj), a.o_proj.bias, a.scaling,
                                _norm(layer.post_attention_layernorm), _weight(m.gate_proj, m.up_proj), gu_b,
                                m.act_fn, _weight(m.down_proj), m.down_proj.bias))
        self.final_norm = _norm(inner.norm)
        # Per layer, [rows, kv_heads, max_len, head_dim]. Columns at or past `length` are never read, so the caches
        # start uninitialised. (Keys cached transposed, [.., head_dim, max_len], made q·kᵀ ~25% faster at 130 keys,
        # but writing a token's key then touches head_dim cache lines per row instead of 2: no faster end to end.)
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.length = 0
        self.key_pad = None  # [rows, max_len] bool: True at left-padding columns; None when there is none

    def _alloc(self, rows):
        p = next(self.model.parameters())
        shape = (rows, self.kv_heads, self.max_len, self.head_dim)
        return [torch.empty(shape, dtype=p.dtype, device=p.device) for _ in range(2 * len(self.layers))]

    def prefill(self, input_ids, attn, position_ids):
        """Runs the prompts [B, T] (left-padded) and fills cache columns 0..T-1; returns the last column's logits."""
        F = torch.nn.functional
        B, T = input_ids.shape
        H, Hk, D = self.heads, self.kv_heads, self.head_dim
        caches = self._alloc(B)
        self.k, self.v = caches[: len(self.layers)], caches[len(self.layers) :]
        mask = None
        if not bool(attn.all()):
            self.key_pad = torch.zeros((B, self.max_len), dtype=torch.bool, device=attn.device)
            self.key_pad[:, :T] = attn == 0
            causal = torch.ones((T, T), dtype=torch.bool, device=attn.device).tril()
            # A padding query may see itself: a fully masked row would turn into NaN and reach the cache.
            mask = (causal & ~self.key_pad[:, None, None, :T]) | torch.eye(T, dtype=torch.bool, device=attn.device)
        cs = self.rope[position_ids]  # [B, T, 2, D]
        cos, sin = cs[:, :, None, 0], cs[:, :, None, 1]
        h = self.inner.embed_tokens(input_ids).flatten(0, 1)  # [B·T, hidden]
        for i, (norm1, w_qkv, b_qkv, w_o, b_o, scale, norm2, w_gu, b_gu, act, w_d, b_d) in enumerate(self.layers):
            qkv = _linear(norm1(h), w_qkv, b_qkv).view(B, T, -1)
            qk = rope_rotate(qkv[..., : (H + Hk) * D].unflatten(-1, (H + Hk, D)), cos, sin)  # [B, T, H + Hk, D]
            q, k = qk[:, :, :H].transpose(1, 2), qk[:, :, H:].transpose(1, 2)
            v = qkv[..., (H + Hk) * D :].unflatten(-1, (Hk, D)).transpose(1, 2)  # [B, Hk, T, D]
            self.k[i][:, :, :T] = k
            self.v[i][:, :, :T] = v
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and T > 1,
                                               scale=scale, enable_gqa=H != Hk)
            h = _linear(o.transpose(1, 2).reshape(B * T, H * D), w_o, b_o, h)
            g, u = _linear(norm2(h), w_gu, b_gu).chunk(2, dim=-1)
            h = _linear(act(g) * u, w_d, b_d, h)
        self.length = T
        return self.model.lm_head(self.final_norm(h.view(B, T, -1)[:, -1]))

    def repeat_rows(self, index):
        """Row j becomes a copy of row index[j] (samples sharing a prompt's prefill); the cache has len(index) rows."""
        caches = self._alloc(len(index))
        for new, old in zip(caches, self.k + self.v):  # only the filled columns are copied
            new[:, :, : self.length] = old[:, :, : self.length].index_select(0, index)
        self.k, self.v = caches[: len(self.layers)], caches[len(self.layers) :]
        if self.key_pad is not None:
            self.key_pad = self.key_pad.index_select(0, index)

    def select_rows(self, keep):
        """Row j becomes row keep[j]; the caches shrink to their first len(keep) rows in place. A new cache would be
        fresh memory, and on CPU faulting its pages in made a drop cost as much as a whole step (~20 ms at 256 rows);
        here only the filled columns of the rows that move are copied (_generate_batch moves few: see there)."""
        K, L = len(keep), self.length
        dst = (keep != torch.arange(K, device=keep.device)).nonzero().squeeze(1)
        if len(dst):
            src = keep[dst]  # all sources are read before any destination is written
            for x in self.k + self.v:
                x[:, :, :L].index_copy_(0, dst, x[:, :, :L].index_select(0, src))
        self.k, self.v = [x[:K] for x in self.k], [x[:K] for x in self.v]
        if self.key_pad is not None:
            self.key_pad = self.key_pad.index_select(0, keep)

    def step(self, tok, pos):
        """One token per row: tok, pos [B]; writes cache column `length`; returns logits [B, vocab]."""
        B, L = tok.shape[0], self.length
        end = L + 1
        H, Hk, D, M = self.heads, self.kv_heads, self.head_dim, self.max_len
        G, nqk = H // Hk, (H + Hk) * D
        cs = self.rope[pos]  # [B, 2, D]
        cos, sin = cs[:, None, 0], cs[:, None, 1]
        pad = None if self.key_pad is None else self.key_pad[:, None, None, :end]
        zero = self.zero.expand(B * Hk, G, end)  # baddbmm's ignored input (beta=0)
        h = self.inner.embed_tokens(tok)  # [B, hidden]: rows stay 2-D, so every projection is one (add)mm
        for i, (norm1, w_qkv, b_qkv, w_o, b_o, scale, norm2, w_gu, b_gu, act, w_d, b_d) in enumerate(self.layers):
            qkv = _linear(norm1(h), w_qkv, b_qkv)
            qk = rope_rotate(qkv[:, :nqk].view(B, H + Hk, D), cos, sin)  # q and k heads rotated in one go
            kc, vc = self.k[i], self.v[i]
            kc[:, :, L] = qk[:, H:]
            vc[:, :, L] = qkv[:, nqk:].view(B, Hk, D)
            # One query per row: the query heads sharing a key/value head become that head's query rows, and plain
            # matmul-softmax-matmul beats SDPA's blocked kernel for a single query (~20% on CPU).
            # alpha = scale: the GEMM scales its result (bitwise what bmm then mul_ gives), one op less.
            keys = kc.view(B * Hk, M, D)[:, :end].transpose(1, 2)
            s = torch.baddbmm(zero, qk[:, :H].reshape(B * Hk, G, D), keys, beta=0, alpha=scale)  # [B·Hk, G, end]
            if pad is not None:
                s.view(B, Hk, G, end).masked_fill_(pad, float("-inf"))
            if end < _SHORT_ROWS:  # torch.softmax is 3-6x slower on rows shorter than one SIMD vector
                p = (s.float() - s.amax(-1, keepdim=True)).exp_()
                p = p.div_(p.sum(-1, keepdim=True))
            else:
                p = torch.softmax(s, dim=-1, dtype=torch.float32)
            o = torch.bmm(p if p.dtype == vc.dtype else p.to(vc.dtype), vc.view(B * Hk, M, D)[:, :end])
            h = _linear(o.view(B, H * D), w_o, b_o, h)
            g, u = _linear(norm2(h), w_gu, b_gu).chunk(2, dim=-1)
            h = _linear(act(g) * u, w_d, b_d, h)
        self.length = end
        return self.model.lm_head(self.final_norm(h))


def rope_table(model, length: int) -> torch.Tensor:
    """Rotary cos and sin of a Qwen2/Llama model for positions 0..length-1, [length, 2, head_dim], for rope_rotate.
    sin carries rotate_half's sign, so x·cos + rotate_half(x)·sin = x·cos + swap_halves(x)·sin_signed."""
    p, D = next(model.parameters()), model.model.layers[0].self_attn.head_dim
    cos, sin = model.model.rotary_emb(torch.empty(0, dtype=p.dtype, device=p.device),
                                      torch.arange(length, device=p.device)[None])
    sin = torch.cat([-sin[0, :, : D // 2], sin[0, :, D // 2 :]], dim=-1)
    return torch.stack([cos[0], sin], dim=1)


def _norm(mod):
    # The model's RMSNorm computes w * (x * rsqrt(mean(x²) + eps)) in float32, which F.rms_norm does in one call
    # (bitwise equal for float32); anything else is called as it is.
    if type(mod).__name__ in LeanDecoder._RMS_NORMS and mod.weight.dtype == torch.float32:
        w, eps, shape = mod.weight, mod.variance_epsilon, tuple(mod.weight.shape)
        return lambda x: torch.nn.functional.rms_norm(x, shape, w, eps)
    return mod


def _weight(*linears):
    """The (fused) weight of nn.Linear layers as the right operand of x @ w. On CPU it is copied out contiguous,
    [in, out]: MKL's sgemm runs ~20% faster at 32 rows than on the [out, in] weight read transposed."""
    ws = [lin.weight for lin in linears]
    if ws[0].device.type == "cpu":
        return torch.cat([w.t() for w in ws], dim=1) if len(ws) > 1 else ws[0].t().contiguous()
    return (torch.cat(ws) if len(ws) > 1 else ws[0]).t()


def _linear(x, w, b, residual=None):
    """x [N, in] @ w [in, out] (+ b) (+ residual), the residual added by the matmul itself when there is no bias."""
    if b is None:
        return torch.mm(x, w) if residual is None else torch.addmm(residual, x, w)
    y = torch.addmm(b, x, w)
    return y if residual is None else residual + y


def rope_rotate(x, cos, sin):
    """Rotary embedding of x [..., D] with LeanDecoder's tables: x·cos + rotate_half(x)·sin in the model's terms
    (rotate_half(x) = [-x2, x1]; the sign lives in the table, so swapping the halves is one flip)."""
    return x * cos + x.unflatten(-1, (2, -1)).flip(-2).flatten(-2) * sin


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
