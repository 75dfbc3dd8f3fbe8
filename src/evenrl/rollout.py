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

# Finished rows are dropped from the batch once this share of it has finished: dropping copies the whole KV cache,
# so doing it at every finished row costs more than computing a few dead rows for some steps.
_COMPACT_DEAD_SHARE = 0.25


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
    decoder: str = "auto",
) -> list[list[Completion]]:
    """Sample `params.samples_per_prompt` completions per prompt; returns [prompt][sample].

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
                _generate_batch(model, prompts[s : s + chunk], keys[s : s + chunk], params, step,
                                set(eos_token_ids), pad_token_id, lean)
            )
        return out
    finally:
        model.train(was_training)


def _generate_batch(model, prompts, keys, params: SamplingParams, step, eos_ids, pad_token_id, lean: bool):
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

    max_new = params.max_new_tokens
    dec = LeanDecoder(model, width + max_new) if lean else _ForwardDecoder(model)
    logits = dec.prefill(input_ids, attn, position_ids)
    if n > 1:  # the n samples of a prompt share its prefill
        dec.repeat_rows(n)
        logits = logits.repeat_interleave(n, dim=0)

    n_rows = n_prompts * n
    seeds = np.array([row_seed(params.seed, step, keys[r // n], r % n) for r in range(n_rows)], dtype=np.uint64)
    next_pos = torch.tensor(lens, device=device).repeat_interleave(n)
    rows = torch.arange(n_rows)  # global row of each batch row
    live = torch.ones(n_rows, dtype=torch.bool)  # batch rows still generating (finished ones wait to be dropped)
    eos = torch.tensor(sorted(eos_ids), dtype=torch.long, device=device)
    out_tok = torch.full((n_rows, max_new), -1, dtype=torch.long)
    out_lp = torch.zeros((n_rows, max_new), dtype=torch.float32)
    length = torch.zeros(n_rows, dtype=torch.long)
    finished = torch.zeros(n_rows, dtype=torch.bool)
    tok_in = torch.full((n_rows,), pad_token_id, dtype=torch.long, device=device)

    for t in range(max_new):
        idx = live.nonzero().squeeze(1)
        all_live = len(idx) == len(live)
        g = rows if all_live else rows[idx]  # global rows sampled at this step
        u = torch.from_numpy(uniforms(seeds[g.numpy()], t))
        tok, lp = sample_from_logits(logits if all_live else logits[idx.to(device)], u, params.temperature,
                                     params.top_p)
        out_tok[g, t] = tok.cpu()
        out_lp[g, t] = lp.cpu()
        length[g] = t + 1
        done = (torch.isin(tok, eos) if len(eos) else torch.zeros_like(tok, dtype=torch.bool)).cpu()
        finished[g[done]] = True
        if t == max_new - 1 or bool(done.all()):
            break
        live[idx[done]] = False
        tok_in[idx.to(device)] = tok
        if (~live).sum() >= max(1, _COMPACT_DEAD_SHARE * len(live)):  # drop finished rows, keep live ones
            keep = live.nonzero().squeeze(1)
            dec.select_rows(keep.to(device))
            rows, tok_in, next_pos = rows[keep], tok_in[keep.to(device)], next_pos[keep.to(device)]
            live = torch.ones(len(keep), dtype=torch.bool)
        logits = dec.step(tok_in, next_pos)
        next_pos = next_pos + 1

    toks, lps, lens_out, fin = out_tok.tolist(), out_lp.tolist(), length.tolist(), finished.tolist()
    completions = [
        Completion(keys[r // n], r % n, toks[r][: lens_out[r]], lps[r][: lens_out[r]], fin[r]) for r in range(n_rows)
    ]
    return [completions[i * n : (i + 1) * n] for i in range(n_prompts)]


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

    def repeat_rows(self, n):
        self.cache.batch_repeat_interleave(n)
        self.attn = self.attn.repeat_interleave(n, dim=0)

    def select_rows(self, keep):
        self.cache.batch_select_indices(keep)
        self.attn = self.attn[keep]

    def step(self, tok, pos):
        self.attn = torch.cat([self.attn, self.attn.new_ones((self.attn.shape[0], 1))], dim=1)
        out = self.model(input_ids=tok[:, None], attention_mask=self.attn, position_ids=pos[:, None],
                         past_key_values=self.cache, use_cache=True)
        self.cache = out.past_key_values
        return out.logits[:, -1, :]


class LeanDecoder:
    """Incremental decoding for plain pre-norm decoder-only LMs (Qwen2, Llama): the model's own modules called
    layer by layer on a KV cache allocated once for prompt + max_new_tokens.

    Why: on CPU, Hugging Face's forward grows its cache with torch.cat at every token (and the row drops copy it),
    which was ~35% of sampling time for a 2.4 M-parameter Qwen2 at 256 rows x 128 tokens. Here a token costs the
    projections (one fused q|k|v and one fused gate|up matmul per layer) and attention over a view of the cache;
    finished rows are dropped in batches (_COMPACT_DEAD_SHARE). Measured on 2 cores: 1.2x (32 rows x 16 tokens)
    to 1.3x (256 rows x 128 tokens) faster than the model's forward. The arithmetic is the model's (same norms,
    rotary embedding, activation and scaling); only the matmul grouping differs, which moves log-probs by float
    rounding (tests compare both decoders and the model's uncached forward).
    """

    ARCHS = ("Qwen2ForCausalLM", "LlamaForCausalLM")

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
        # Sharded (DTensor) parameters are gathered by hooks on the wrapped modules' forward, which we bypass.
        return all(type(p.data) is torch.Tensor for p in model.parameters())

    def __init__(self, model, max_len: int):
        import sys

        inner = model.model
        self.model, self.inner, self.max_len = model, inner, max_len
        first = inner.layers[0].self_attn
        self.head_dim = first.head_dim
        self.heads = model.config.num_attention_heads
        self.kv_heads = model.config.num_key_value_heads
        self.rope = sys.modules[type(first).__module__].apply_rotary_pos_emb
        self.fused = []
        for layer in inner.layers:  # weights change every optimizer step, so fuse per generate call
            a, m = layer.self_attn, layer.mlp
            qkv_b = None
            if a.q_proj.bias is not None:
                qkv_b = torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias])
            gu_b = torch.cat([m.gate_proj.bias, m.up_proj.bias]) if m.gate_proj.bias is not None else None
            self.fused.append((torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]), qkv_b,
                               torch.cat([m.gate_proj.weight, m.up_proj.weight]), gu_b))
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.length = 0
        self.key_ok = None  # [rows, max_len] bool: False at left-padding columns; None when there is none

    def _forward(self, ids, pos, mask):
        """ids, pos [B, T]; writes the T new keys/values at columns length..length+T; returns last-column logits."""
        F = torch.nn.functional
        B, T = ids.shape
        h = self.inner.embed_tokens(ids)
        cos, sin = self.inner.rotary_emb(h, pos)
        end = self.length + T
        H, Hk, D = self.heads, self.kv_heads, self.head_dim
        for i, layer in enumerate(self.inner.layers):
            attn = layer.self_attn
            w_qkv, b_qkv, w_gu, b_gu = self.fused[i]
            x = layer.input_layernorm(h)
            q, k, v = F.linear(x, w_qkv, b_qkv).split([H * D, Hk * D, Hk * D], dim=-1)
            q = q.view(B, T, H, D).transpose(1, 2)
            k = k.view(B, T, Hk, D).transpose(1, 2)
            q, k = self.rope(q, k, cos, sin)
            self.k[i][:, :, self.length:end] = k
            self.v[i][:, :, self.length:end] = v.view(B, T, Hk, D).transpose(1, 2)
            keys, values = self.k[i][:, :, :end], self.v[i][:, :, :end]
            if T == 1:
                # One query per row: the query heads sharing a key/value head become that head's query rows, and
                # plain matmul-softmax-matmul beats SDPA's blocked kernel for a single query (~20% on CPU).
                s = torch.matmul(q.reshape(B, Hk, H // Hk, D), keys.transpose(-1, -2)).mul_(attn.scaling)
                if mask is not None:
                    s.masked_fill_(~mask, float("-inf"))
                o = torch.matmul(torch.softmax(s, dim=-1, dtype=torch.float32).to(values.dtype), values)
            else:
                o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=mask is None and T > 1,
                                                   scale=attn.scaling, enable_gqa=H != Hk)
            h = h + attn.o_proj(o.reshape(B, H, T, D).transpose(1, 2).reshape(B, T, H * D))
            x = layer.post_attention_layernorm(h)
            g, u = F.linear(x, w_gu, b_gu).chunk(2, dim=-1)
            h = h + layer.mlp.down_proj(layer.mlp.act_fn(g) * u)
        self.length = end
        return self.model.lm_head(self.inner.norm(h[:, -1]))

    def prefill(self, input_ids, attn, position_ids):
        B, T = input_ids.shape
        p = next(self.model.parameters())
        shape = (B, self.kv_heads, self.max_len, self.head_dim)
        self.k = [torch.zeros(shape, dtype=p.dtype, device=p.device) for _ in self.inner.layers]
        self.v = [torch.zeros(shape, dtype=p.dtype, device=p.device) for _ in self.inner.layers]
        mask = None
        if not bool(attn.all()):
            self.key_ok = torch.ones((B, self.max_len), dtype=torch.bool, device=attn.device)
            self.key_ok[:, :T] = attn.bool()
            causal = torch.ones((T, T), dtype=torch.bool, device=attn.device).tril()
            # A padding query may see itself: a fully masked row would turn into NaN and reach the cache.
            mask = (causal & self.key_ok[:, None, None, :T]) | torch.eye(T, dtype=torch.bool, device=attn.device)
        return self._forward(input_ids, position_ids, mask)

    def repeat_rows(self, n):
        self.k = [x.repeat_interleave(n, dim=0) for x in self.k]
        self.v = [x.repeat_interleave(n, dim=0) for x in self.v]
        if self.key_ok is not None:
            self.key_ok = self.key_ok.repeat_interleave(n, dim=0)

    def select_rows(self, keep):
        self.k = [x.index_select(0, keep) for x in self.k]
        self.v = [x.index_select(0, keep) for x in self.v]
        if self.key_ok is not None:
            self.key_ok = self.key_ok.index_select(0, keep)

    def step(self, tok, pos):
        mask = None if self.key_ok is None else self.key_ok[:, None, None, : self.length + 1]
        return self._forward(tok[:, None], pos[:, None], mask)


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
