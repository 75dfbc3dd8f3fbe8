"""LeanDecoder: incremental decoding of plain pre-norm decoder-only LMs (Qwen2, Llama) on a KV cache allocated once,
at shapes that shrink with the live rows, or static ones a CUDA graph can replay (evenrl.models.decode_graph); and
the rotary helpers the packed training forward (evenrl.models.forward) shares with it."""

from __future__ import annotations

import contextlib

import torch

from evenrl.models.files import LEAN_ARCHS
from evenrl.models.lora import effective_weight


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

    Under a replicated model's autocast (fp32 master weights, models.loading.set_autocast) the fused weights, the
    output layer and the cache are cast to the autocast dtype once per call and the steps run with autocast off:
    autocast re-casts every weight that is not a parameter (the fused ones) at every token, ~100 extra kernels per
    step of a 24-layer model. The residual stream stays fp32 and each norm's output is rounded once, as the model's
    forward under autocast does.

    static=True keeps every shape of a step fixed for the whole generation, so that a CUDA graph can replay it: the
    rows never shrink (finished rows are computed and ignored), the cache is zeroed, and a step attends over all
    max_len columns with the columns past the current length masked; the length lives in a device tensor
    (length_t) that the step advances itself. Same arithmetic per row, so the same samples as static=False up to
    float rounding of the longer (masked) softmax sums.
    """

    ARCHS = LEAN_ARCHS
    _RMS_NORMS = ("Qwen2RMSNorm", "LlamaRMSNorm")

    @classmethod
    def supports(cls, model) -> bool:
        if not any(c.__name__ in cls.ARCHS for c in type(model).__mro__):  # FSDP2 subclasses the model's class
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

    def __init__(self, model, max_len: int, *, static: bool = False, cache: dict | None = None):
        inner = model.model
        self.model, self.inner, self.max_len, self.static = model, inner, max_len, static
        first = inner.layers[0].self_attn
        self.head_dim = first.head_dim
        self.heads = model.config.num_attention_heads
        self.kv_heads = model.config.num_key_value_heads
        p = next(model.parameters())
        dev = p.device.type
        cast = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None
        self.cast = cast if cast is not None and cast != p.dtype else None
        self.dtype = self.cast or p.dtype  # of the weights the steps multiply by, the cache and the logits
        self.rope = rope_table(model, max_len)  # once per call: the model recomputes it at every token
        self.zero = torch.zeros((), dtype=self.dtype, device=p.device)
        # `cache` (an engine's, evenrl.engines.hf): the fused weights of its last call, kept while nothing they are
        # made of changed (weights_key); fusing anew cost ~0.2 s of each call for a 30.8 M model on CPU, and a step
        # makes one call per prompt batch under bitwise, one per turn with environments or agents
        if cache is None:
            fused = self._fuse(model)
        else:
            key = weights_key(model, self.cast)
            if cache.get("key") != key:
                cache.clear()  # the old copy freed before the new one is made
                cache.update(key=key, fused=self._fuse(model))
            fused = cache["fused"]
        self.layers, self.final_norm, self.head = fused
        self.cols = torch.arange(max_len, device=p.device) if static else None
        self.length_t = None  # static: the filled columns, a device tensor [1]
        # Per layer, [rows, kv_heads, max_len, head_dim]. Columns at or past `length` are never read (static: read
        # and masked), so the caches start uninitialised (static: zeroed, see _alloc). (Keys cached transposed, [.., head_dim, max_len], made q·kᵀ ~25% faster at 130 keys,
        # but writing a token's key then touches head_dim cache lines per row instead of 2: no faster end to end.)
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.length = 0
        self.key_pad = None  # [rows, max_len] bool: True at left-padding columns; None when there is none

    def _fuse(self, model):
        """(layers, final norm, output layer): each layer's weights fused and pre-transposed, cast to the autocast
        dtype if any (see the class docstring)."""
        c, layers = self._cast, []
        for layer in model.model.layers:
            a, m = layer.self_attn, layer.mlp
            qkv_b = None
            if a.q_proj.bias is not None:
                qkv_b = c(torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]))
            gu_b = c(torch.cat([m.gate_proj.bias, m.up_proj.bias])) if m.gate_proj.bias is not None else None
            layers.append((_norm(layer.input_layernorm, self.cast), c(_weight(a.q_proj, a.k_proj, a.v_proj)),
                           qkv_b, c(_weight(a.o_proj)), c(a.o_proj.bias), a.scaling,
                           _norm(layer.post_attention_layernorm, self.cast), c(_weight(m.gate_proj, m.up_proj)),
                           gu_b, m.act_fn, c(_weight(m.down_proj)), c(m.down_proj.bias)))
        head = model.lm_head
        head = head if self.cast is None else (lambda x, w=c(head.weight), b=c(head.bias): _linear(x, w.t(), b))
        return layers, _norm(model.model.norm, self.cast), head

    def _cast(self, t):
        return t if t is None or self.cast is None else t.to(self.cast)

    def _alloc(self, rows):
        shape = (rows, self.kv_heads, self.max_len, self.head_dim)
        # static: a step reads every column (masked), and 0 x NaN from uninitialised values would reach the output
        new = torch.zeros if self.static else torch.empty
        return [new(shape, dtype=self.dtype, device=self.zero.device) for _ in range(2 * len(self.layers))]

    def _precision(self):
        """The steps' autocast state: off when the weights are already cast (see the class docstring)."""
        if self.cast is None:
            return contextlib.nullcontext()
        return torch.autocast(self.zero.device.type, enabled=False)

    def prefill(self, input_ids, attn, position_ids):
        """Runs the prompts [B, T] (left-padded) and fills cache columns 0..T-1; returns the last column's logits."""
        with self._precision():
            return self._prefill(input_ids, attn, position_ids)

    def _prefill(self, input_ids, attn, position_ids):
        F = torch.nn.functional
        B, T = input_ids.shape
        H, Hk, D, dt = self.heads, self.kv_heads, self.head_dim, self.dtype
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
            qk = rope_rotate(qkv[..., : (H + Hk) * D].unflatten(-1, (H + Hk, D)), cos, sin).to(dt)  # [B, T, H+Hk, D]
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
        if self.static:
            self.length_t = torch.tensor([T], device=input_ids.device)
        return self.head(self.final_norm(h.view(B, T, -1)[:, -1]))

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
        """One token per row: tok, pos [B]; writes cache column `length` (static: length_t); returns logits
        [B, vocab]. Static steps take no value to the host, so that a CUDA graph can capture one."""
        with self._precision():
            return self._step(tok, pos)

    def _step(self, tok, pos):
        B, dt = tok.shape[0], self.dtype
        H, Hk, D, M = self.heads, self.kv_heads, self.head_dim, self.max_len
        G, nqk = H // Hk, (H + Hk) * D
        if self.static:
            end, L = M, self.length_t  # every column, those past the length masked
            pad = self.cols > L
            pad = pad[None, None, None] if self.key_pad is None else (self.key_pad | pad)[:, None, None]
        else:
            L = self.length
            end = L + 1
            pad = None if self.key_pad is None else self.key_pad[:, None, None, :end]
        cs = self.rope[pos]  # [B, 2, D]
        cos, sin = cs[:, None, 0], cs[:, None, 1]
        zero = self.zero.expand(B * Hk, G, end)  # baddbmm's ignored input (beta=0)
        h = self.inner.embed_tokens(tok)  # [B, hidden]: rows stay 2-D, so every projection is one (add)mm
        for i, (norm1, w_qkv, b_qkv, w_o, b_o, scale, norm2, w_gu, b_gu, act, w_d, b_d) in enumerate(self.layers):
            qkv = _linear(norm1(h), w_qkv, b_qkv)
            qk = rope_rotate(qkv[:, :nqk].view(B, H + Hk, D), cos, sin).to(dt)  # q and k heads rotated in one go
            kc, vc = self.k[i], self.v[i]
            if self.static:
                kc.index_copy_(2, L, qk[:, H:, None])
                vc.index_copy_(2, L, qkv[:, nqk:].view(B, Hk, 1, D))
            else:
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
        if self.static:
            self.length_t.add_(1)
        else:
            self.length = end
        return self.head(self.final_norm(h))


def rope_table(model, length: int) -> torch.Tensor:
    """Rotary cos and sin of a Qwen2/Llama model for positions 0..length-1, [length, 2, head_dim], for rope_rotate.
    sin carries rotate_half's sign, so x·cos + rotate_half(x)·sin = x·cos + swap_halves(x)·sin_signed."""
    p, D = next(model.parameters()), model.model.layers[0].self_attn.head_dim
    cos, sin = model.model.rotary_emb(torch.empty(0, dtype=p.dtype, device=p.device),
                                      torch.arange(length, device=p.device)[None])
    sin = torch.cat([-sin[0, :, : D // 2], sin[0, :, D // 2 :]], dim=-1)
    return torch.stack([cos[0], sin], dim=1)


def weights_key(model, cast) -> tuple:
    """What LeanDecoder's fused weights are made of: each parameter's storage and version counter (an in-place write
    through a parameter moves it: the optimizer's step, load_state_dict's copy, an engine's weight push), each LoRA
    layer's adapter switch, the autocast dtype. Only for parameters that keep their storage between calls: not
    FSDP2's, gathered into new tensors for each call (whose version counters start again at 0)."""
    return (cast, tuple((p.data_ptr(), p._version) for p in model.parameters()),
            tuple(bool(m.disable_adapters) for m in model.modules() if hasattr(m, "base_layer")))


def _norm(mod, cast=None):
    # The model's RMSNorm computes w * (x * rsqrt(mean(x²) + eps)) in float32, which F.rms_norm does in one call
    # (bitwise equal for float32); anything else is called as it is. `cast`: the output rounded to the dtype of the
    # (cast) weights the next matmul multiplies by.
    if type(mod).__name__ in LeanDecoder._RMS_NORMS and mod.weight.dtype == torch.float32:
        w, eps, shape = mod.weight, mod.variance_epsilon, tuple(mod.weight.shape)
        if cast is not None:
            return lambda x: torch.nn.functional.rms_norm(x, shape, w, eps).to(cast)
        return lambda x: torch.nn.functional.rms_norm(x, shape, w, eps)
    return mod if cast is None else (lambda x: mod(x).to(cast))


def _weight(*linears):
    """The (fused) weight of nn.Linear layers as the right operand of x @ w. On CPU it is copied out contiguous,
    [in, out]: MKL's sgemm runs ~20% faster at 32 rows than on the [out, in] weight read transposed."""
    ws = [effective_weight(lin) for lin in linears]  # a LoRA adapter's update merged in: once per generate call
    if ws[0].device.type == "cpu":
        return torch.cat([w.t() for w in ws], dim=1) if len(ws) > 1 else ws[0].t().contiguous()
    return (torch.cat(ws) if len(ws) > 1 else ws[0]).t()


def _linear(x, w, b, residual=None):
    """x [N, in] @ w [in, out] (+ b) (+ residual), the residual added by the matmul itself when there is no bias and
    it has the weight's dtype (a float32 residual stream beside cast weights: added after, in float32)."""
    if residual is not None and residual.dtype != w.dtype:
        return residual + _linear(x, w, b)
    if b is None:
        return torch.mm(x, w) if residual is None else torch.addmm(residual, x, w)
    y = torch.addmm(b, x, w)
    return y if residual is None else residual + y


def rope_rotate(x, cos, sin):
    """Rotary embedding of x [..., D] with LeanDecoder's tables: x·cos + rotate_half(x)·sin in the model's terms
    (rotate_half(x) = [-x2, x1]; the sign lives in the table, so swapping the halves is one flip)."""
    return x * cos + x.unflatten(-1, (2, -1)).flip(-2).flatten(-2) * sin
