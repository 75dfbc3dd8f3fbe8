"""Log-probs and entropy straight from hidden states through the output projection, chunk by chunk, with a backward
of its own: no [tokens, vocabulary] tensor exists in either pass.

    logp, entropy = head_logprobs(hidden, weight, bias, targets, temperature)     # hidden [N, H], weight [V, H]

The plain path computes logits = hidden @ weight.T (+ bias) for every response token, then log-softmax; for a
150 k-token vocabulary that tensor (and autograd's copy of it for the backward) is the largest thing in a training
step: 11 k tokens x 151,936 x 4 bytes = 6.7 GB. Here the forward keeps only each row's log-sum-exp and entropy, and
the backward recomputes one chunk of logits at a time to form the gradient
  d logp_t / d z_j  = [j = t] - p_j
  d H / d z_j       = -p_j (log p_j + H)
(z = logits / temperature), then dhidden = G @ weight and dweight = G.T @ hidden. Peak extra memory is a few chunks of
`_CHUNK_ELEMENTS` float32 values, whatever the number of tokens. The values equal the plain path's (same matmul,
same float32 log-sum-exp per row); tests/test_fused_head.py compares values and gradients.

Liger-Kernel's fused linear cross-entropy does the same with Triton kernels (GPU only); this is the same
arithmetic in torch, so it runs wherever torch does.
"""

from __future__ import annotations

import contextlib

import torch

from evenrl.errors import bad

# Float32 values per chunk of logits: 16 M (64 MB); a 151,936-token vocabulary gives 110 rows per chunk.
_CHUNK_ELEMENTS = 1 << 24


def head_logprobs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                  temperature: float = 1.0, *, entropy: bool = True, entropy_grad: bool = False,
                  chunk_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log softmax(z)[targets], entropy of softmax(z) or None) per row, z = (hidden @ weight.T + bias) / T, in
    float32 (or float64 for float64 inputs).

    hidden [..., H], targets [...] int, weight [V, H], bias [V] or None; both outputs have targets' shape.
    The log-probs carry gradients to hidden, weight and bias; the entropy (computed unless entropy=False, which
    saves a pass over the vocabulary) does too only with entropy_grad (an entropy bonus in the loss), else it is a
    measurement and costs no backward work."""
    if not temperature > 0:
        raise bad("temperature", temperature, "a number > 0")
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"hidden [..., H] and targets [...] disagree: {tuple(hidden.shape)}, {tuple(targets.shape)}")
    rows = chunk_rows or max(1, _CHUNK_ELEMENTS // max(1, weight.shape[0]))
    device = hidden.device.type
    with contextlib.ExitStack() as stack:
        if torch.is_autocast_enabled(device):  # mixed precision: cast the output matrix once, not once per chunk
            dtype = torch.get_autocast_dtype(device)
            hidden, weight = hidden.to(dtype), weight.to(dtype)
            bias = bias.to(dtype) if bias is not None else None
            stack.enter_context(torch.autocast(device, enabled=False))
        logp, ent = _HeadLogprobs.apply(hidden.reshape(-1, hidden.shape[-1]), weight, bias, targets.reshape(-1),
                                        1.0 / temperature, rows, entropy, entropy and entropy_grad)
    return logp.reshape(targets.shape), ent.reshape(targets.shape) if entropy else None


def _logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, inv_t: float) -> torch.Tensor:
    """One chunk's z, computed in the inputs' precision as the model's head computes its logits, in float32 at
    least."""
    z = torch.nn.functional.linear(h, weight, bias)
    z = z.to(torch.promote_types(z.dtype, torch.float32))
    return z if inv_t == 1.0 else z.mul_(inv_t)


class _HeadLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, inv_t, rows, with_entropy, entropy_grad):
        n = hidden.shape[0]
        logp = torch.empty(n, dtype=torch.promote_types(hidden.dtype, torch.float32), device=hidden.device)
        entropy = torch.empty_like(logp)
        lse = torch.empty_like(logp)
        for s in range(0, n, rows):
            z = _logits(hidden[s:s + rows], weight, bias, inv_t)
            lse[s:s + rows] = torch.logsumexp(z, dim=-1)
            logp[s:s + rows] = z.gather(-1, targets[s:s + rows, None]).squeeze(-1) - lse[s:s + rows]
            if not with_entropy:
                continue
            z.sub_(lse[s:s + rows, None]).clamp_(min=torch.finfo(z.dtype).min)  # log p; -inf logits give 0 below
            entropy[s:s + rows] = -z.exp().mul_(z).sum(-1)
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy)
        ctx.inv_t, ctx.rows, ctx.entropy_grad = inv_t, rows, entropy_grad
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp, g_entropy):
        hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors
        inv_t, rows = ctx.inv_t, ctx.rows
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        g_entropy = g_entropy if ctx.entropy_grad else None
        d_hidden = torch.empty_like(hidden) if need_h else None
        acc = torch.promote_types(weight.dtype, torch.float32)  # low-precision weights: sum their gradient in float32
        d_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        d_bias = torch.zeros(bias.shape, dtype=acc, device=bias.device) if need_b else None
        for s in range(0, hidden.shape[0], rows):
            h = hidden[s:s + rows]
            z = _logits(h, weight, bias, inv_t)
            logp = z.sub_(lse[s:s + rows, None])
            p = logp.exp()
            grad = p * -g_logp[s:s + rows, None]  # d logp_t / d z = onehot(t) - p, times the incoming gradient
            grad.scatter_add_(-1, targets[s:s + rows, None], g_logp[s:s + rows, None])
            if g_entropy is not None:  # d H / d z = -p (log p - E_p[log p]) = -p (log p + H)
                logp.clamp_(min=torch.finfo(logp.dtype).min).add_(entropy[s:s + rows, None])
                grad.sub_(p.mul_(logp).mul_(g_entropy[s:s + rows, None]))
            if inv_t != 1.0:
                grad.mul_(inv_t)
            if need_h:
                d_hidden[s:s + rows] = (grad.to(h.dtype) @ weight.to(h.dtype))
            if need_w:
                d_weight.addmm_(grad.to(acc).T, h.to(acc))
            if need_b:
                d_bias.add_(grad.to(acc).sum(0))
        return (d_hidden, None if d_weight is None else d_weight.to(weight.dtype),
                None if d_bias is None else d_bias.to(bias.dtype), None, None, None, None, None)
