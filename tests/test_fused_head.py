"""core.fused_head against the plain path (logits, then core.losses' log-probs and entropy): the same values and
gradients, and no vocabulary-sized tensor kept for the backward."""

import pytest
import torch

from evenrl.core.fused_head import head_logprobs
from evenrl.core.losses import entropy_from_logits, token_logprobs


def _case(n=37, h=16, v=301, bias=False, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=dtype, requires_grad=True)
    weight = torch.randn(v, h, generator=g, dtype=dtype).mul_(0.5).requires_grad_()
    b = torch.randn(v, generator=g, dtype=dtype).requires_grad_() if bias else None
    targets = torch.randint(0, v, (n,), generator=g)
    a, c = torch.randn(n, generator=g, dtype=dtype), torch.randn(n, generator=g, dtype=dtype)
    return hidden, weight, b, targets, a, c


def _plain(hidden, weight, bias, targets, t):
    logits = torch.nn.functional.linear(hidden, weight, bias)
    return token_logprobs(logits, targets, t), entropy_from_logits(logits, t)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("entropy_grad", [False, True])
def test_values_and_gradients_equal_the_plain_path(temperature, bias, entropy_grad):
    hidden, weight, b, targets, a, c = _case(bias=bias, dtype=torch.float32)
    params = [hidden, weight] + ([b] if bias else [])
    lp, ent = _plain(hidden, weight, b, targets, temperature)
    loss = (a * lp).sum() + ((c * ent).sum() if entropy_grad else 0.0)
    want = torch.autograd.grad(loss, params)
    lp2, ent2 = head_logprobs(hidden, weight, b, targets, temperature, entropy_grad=entropy_grad, chunk_rows=5)
    assert torch.allclose(lp2, lp, rtol=0, atol=2e-6) and torch.allclose(ent2, ent, rtol=0, atol=2e-6)
    loss2 = (a * lp2).sum() + ((c * ent2).sum() if entropy_grad else 0.0)
    got = torch.autograd.grad(loss2, params)
    for x, y in zip(got, want):
        assert ((x - y).norm() / y.norm()).item() <= 1e-6


def test_entropy_without_entropy_grad_is_a_measurement():
    hidden, weight, _, targets, _, _ = _case(dtype=torch.float32)
    _, ent = head_logprobs(hidden, weight, None, targets)
    assert not ent.requires_grad


def test_gradient_matches_finite_differences_in_float64():
    """The hand-written backward against torch's numerical check (log-probs and an entropy bonus together)."""
    hidden, weight, b, targets, _, _ = _case(n=6, h=4, v=9, bias=True)

    def f(h, w, bias):
        lp, ent = head_logprobs(h, w, bias, targets, 0.8, entropy_grad=True, chunk_rows=4)
        return lp, ent

    assert torch.autograd.gradcheck(f, (hidden, weight, b))


def test_no_vocabulary_sized_tensor_is_kept_for_backward():
    """What autograd saves between forward and backward: the plain path keeps [tokens, vocabulary] logits, the fused
    one only the inputs and one number per token."""
    n, v = 64, 4096
    hidden, weight, _, targets, a, _ = _case(n=n, v=v, dtype=torch.float32)
    for fused in (False, True):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
            lp = head_logprobs(hidden, weight, None, targets, chunk_rows=16)[0] if fused else \
                _plain(hidden, weight, None, targets, 1.0)[0]
        (a * lp).sum().backward()
        if fused:
            assert max(saved) == weight.numel() and n * v not in saved
        else:
            assert n * v in saved


def test_log_probs_alone_skip_the_entropy():
    hidden, weight, _, targets, _, _ = _case(dtype=torch.float32)
    lp, ent = head_logprobs(hidden, weight, None, targets, entropy=False, chunk_rows=7)
    assert ent is None and torch.equal(lp, head_logprobs(hidden, weight, None, targets, chunk_rows=7)[0])
