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

The log-sum-exp is max + log(sum of exp), the sum accumulated in float64. With a vocabulary split over a
tensor-parallel group (`vocab_shard`: this rank's rows start at `offset` of `vocab`; `reduce(t, "max" | "sum")`
all-reduces in place over the group), each rank takes the row's maximum over the group first, sums its slice's
exps (and finds the target's logit where the target is its own, 0 elsewhere), and sums of per-token numbers combine
the slices (Megatron's vocabulary-parallel cross-entropy): the same exps as on one device, added in another order
in float64, so the log-probs agree to float32 rounding. The backward needs no collective here: the gradient of the
hidden states is each rank's part, summed by the caller (evenrl.distributed.tensor_parallel).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch

from evenrl.errors import bad

# Float32 values per chunk of logits: 16 M (64 MB); a 151,936-token vocabulary gives 110 rows per chunk.
_CHUNK_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class VocabShard:
    """This rank's rows of a vocabulary split over a group: [offset, offset + rows of the weight) of `vocab`, and
    `reduce(tensor, "max" | "sum")`, an in-place all-reduce over the group that returns the tensor."""

    offset: int
    vocab: int
    reduce: Callable[[torch.Tensor, str], torch.Tensor]


def head_logprobs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                  temperature: float = 1.0, *, entropy: bool = True, entropy_grad: bool = False,
                  chunk_rows: int | None = None, vocab_shard: VocabShard | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log softmax(z)[targets], entropy of softmax(z) or None) per row, z = (hidden @ weight.T + bias) / T, in
    float32 (or float64 for float64 inputs).

    hidden [..., H], targets [...] int, weight [V, H], bias [V] or None; both outputs have targets' shape.
    The log-probs carry gradients to hidden, weight and bias; the entropy (computed unless entropy=False, which
    saves a pass over the vocabulary) does too only with entropy_grad (an entropy bonus in the loss), else it is a
    measurement and costs no backward work. vocab_shard: `weight` (and bias) are this rank's rows of a split
    vocabulary (see the module docstring); targets are ids in the whole vocabulary."""
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
                                        1.0 / temperature, rows, entropy, entropy and entropy_grad, vocab_shard)
    return logp.reshape(targets.shape), ent.reshape(targets.shape) if entropy else None


def _logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, inv_t: float) -> torch.Tensor:
    """One chunk's z, computed in the inputs' precision as the model's head computes its logits, in float32 at
    least."""
    z = torch.nn.functional.linear(h, weight, bias)
    z = z.to(torch.promote_types(z.dtype, torch.float32))
    return z if inv_t == 1.0 else z.mul_(inv_t)


class _HeadLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, inv_t, rows, with_entropy, entropy_grad, shard):
        n = hidden.shape[0]
        logp = torch.empty(n, dtype=torch.promote_types(hidden.dtype, torch.float32), device=hidden.device)
        entropy = torch.empty_like(logp)
        lse = torch.empty_like(logp)
        local, here = _local_targets(targets, weight.shape[0], shard)
        reduce = shard.reduce if shard is not None else (lambda t, op: t)
        wide = torch.promote_types(logp.dtype, torch.float64)
        for s in range(0, n, rows):
            z = _logits(hidden[s:s + rows], weight, bias, inv_t)
            # log-sum-exp as max + log(sum of exp), the sum in float64: one device and a vocabulary split over a
            # group then compute the same exps and differ only in float64's order of addition, which the float32
            # result does not see (a split float32 logsumexp moved log-probs by up to 4 ulps)
            top = reduce(z.amax(-1), "max")
            picked = torch.where(here[s:s + rows] > 0, z.gather(-1, local[s:s + rows, None]).squeeze(-1), 0.0)
            sums = reduce(torch.stack([(z - top[:, None]).exp_().sum(-1, dtype=wide), picked.to(wide)]), "sum")
            lse[s:s + rows] = top.to(wide) + sums[0].log()
            logp[s:s + rows] = sums[1].to(logp.dtype) - lse[s:s + rows]
            if not with_entropy:
                continue
            z.sub_(lse[s:s + rows, None]).clamp_(min=torch.finfo(z.dtype).min)  # log p; -inf logits give 0 below
            entropy[s:s + rows] = -reduce(z.exp().mul_(z).sum(-1, dtype=wide), "sum")
        ctx.save_for_backward(hidden, weight, bias, local, here, lse, entropy)
        ctx.inv_t, ctx.rows, ctx.entropy_grad = inv_t, rows, entropy_grad
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp, g_entropy):
        hidden, weight, bias, local, here, lse, entropy = ctx.saved_tensors
        inv_t, rows = ctx.inv_t, ctx.rows
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        g_entropy = g_entropy if ctx.entropy_grad else None
        g_target = g_logp * here  # only the rank holding a target's row has its one-hot term
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
            grad.scatter_add_(-1, local[s:s + rows, None], g_target[s:s + rows, None])
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
                None if d_bias is None else d_bias.to(bias.dtype), None, None, None, None, None, None)


def _local_targets(targets: torch.Tensor, rows: int, shard: VocabShard | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(each target's row in this weight, clamped into it; 1.0 where that row is the target's, else 0.0)."""
    if shard is None:
        return targets, torch.ones(targets.shape, dtype=torch.float32, device=targets.device)
    local = targets - shard.offset
    here = (local >= 0) & (local < rows)
    return local.clamp(0, rows - 1), here.to(torch.float32)
