"""The sampler's static-shape decoder (rollout.decoder=static: the CUDA-graph path) and the lean decoder under a
replicated model's autocast, on CPU. The graph capture itself needs CUDA; what it needs of the step (one graph, no
value read back to the host, no shape that changes between tokens) is checked here by compiling the step whole."""

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from e2e import requests, with_random_adapters
from evenrl.engines.hf import SamplingParams, generate
from evenrl.models.decode_graph import DecodeStep
from evenrl.models.decoder import LeanDecoder
from evenrl.models.loading import load_policy, set_autocast
from evenrl.testing import make_tiny_model
from evenrl.train.data import encode_prompt


pytestmark = pytest.mark.usefixtures("one_thread")


def run(model, prompts, params, eos, decoder):
    return generate(model, requests(prompts, list(range(len(prompts))), 2), params, eos_token_ids=set(eos),
                    pad_token_id=0, decoder=decoder)


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen2+lora"])
def test_static_decoder_gives_the_lean_decoders_samples(tmp_path, arch):
    """Left padding, GQA, rows finishing at different steps (the eos set is ~11% of the vocab) and (qwen2) all of
    them before max_new_tokens, top-p: same tokens, finished flags and log-probs to float rounding as the shrinking
    lean decoder and the model's own forward."""
    model, tok = load_policy(make_tiny_model(str(tmp_path), arch=arch.split("+")[0], seed=5))
    if arch.endswith("+lora"):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)  # adapters that finish every row: the same whichever tests ran before
            with_random_adapters(model)
    prompts = [encode_prompt(tok, t, False) for t in ("7+8=", "countdown 3 5 7 to 15:", "12*3=", "x")]
    eos = {1} | set(encode_prompt(tok, "0123456789", False))
    params = SamplingParams(max_new_tokens=40, temperature=0.9, top_p=0.95, samples_per_prompt=5, seed=3)
    ref = {d: run(model, prompts, params, eos, d) for d in ("forward", "lean")}
    static = run(model, prompts, params, eos, "static")
    lengths, finished = [len(c.token_ids) for r in static for c in r], [c.finished for r in static for c in r]
    assert len(set(lengths)) > 3 and sum(finished) > len(finished) / 2
    if arch == "qwen2":  # every row finished early: the generation stops at an EOS check, not at max_new_tokens
        assert all(finished) and max(lengths) < 40
    for name, want in ref.items():
        for rw, rs in zip(want, static):
            for w, c in zip(rw, rs):
                assert (w.token_ids, w.finished) == (c.token_ids, c.finished), name
                np.testing.assert_allclose(c.logprobs, w.logprobs, atol=1e-5, err_msg=name)


def test_static_decoder_without_eos_samples_every_token(tmp_path):
    model, tok = load_policy(make_tiny_model(str(tmp_path), seed=1))
    prompts = [encode_prompt(tok, t, False) for t in ("1+1=", "a longer prompt: 9-4=")]
    params = SamplingParams(max_new_tokens=20, samples_per_prompt=3, seed=4)
    lean, static = run(model, prompts, params, (), "lean"), run(model, prompts, params, (), "static")
    assert [c.token_ids for r in static for c in r] == [c.token_ids for r in lean for c in r]
    assert all(len(c.token_ids) == 20 and not c.finished for r in static for c in r)


def test_static_step_is_one_graph_with_fixed_shapes(tmp_path):
    """What a CUDA graph capture needs: the whole step traces as one graph (fullgraph: no value read back to the
    host, no data-dependent branch) and the traced graph serves every token (a recompile means a shape or a Python
    value changed between steps). The compiled steps give the eager steps' logits."""
    import torch._dynamo

    model, tok = load_policy(make_tiny_model(str(tmp_path), arch="llama", seed=2))
    ids = torch.tensor([[0, 0, 7, 8, 9], [3, 4, 5, 6, 7]])
    attn = (torch.arange(5) >= torch.tensor([[2], [0]])).long()
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    decs = [LeanDecoder(model, 5 + 12, static=True) for _ in range(2)]
    with torch.inference_mode():
        first = [d.prefill(ids, attn, pos) for d in decs]
    torch._dynamo.reset()
    steps = [DecodeStep(decs[0], pos[:, -1] + 1), DecodeStep(decs[1], pos[:, -1] + 1)]
    compiled = torch.compile(steps[1].dec.step, fullgraph=True, backend="eager", dynamic=False)
    steps[1].dec.step = compiled
    with torch.inference_mode(), torch._dynamo.config.patch(error_on_recompile=True):
        tok_e = tok_c = first[0].argmax(-1)
        for _ in range(10):
            eager, traced = steps[0](tok_e), steps[1](tok_c)
            torch.testing.assert_close(traced, eager, rtol=0, atol=1e-6)
            tok_e, tok_c = eager.argmax(-1), traced.argmax(-1)
    assert int(decs[1].length_t) == 5 + 10 and torch.equal(steps[1].pos, pos[:, -1] + 11)


class _Casts(TorchDispatchMode):
    """The largest tensor converted to another dtype (a float32 weight cast per step would be the largest)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten._to_copy.default, torch.ops.aten.to.dtype):
            self.largest = max(self.largest, args[0].numel())
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("static", [False, True])
def test_lean_decoder_under_autocast_casts_weights_once_per_call(tmp_path, static):
    """A replicated bf16 model (fp32 master weights, autocast): the fused weights and the output layer are cast
    once when the decoder is built, and a decoding step converts only activations (before, autocast cast every
    fused weight at every token: they are not parameters, so its cache skipped them). The samples' log-probs stay
    within bf16 rounding of the model's own forward under the same autocast."""
    model, tok = load_policy(make_tiny_model(str(tmp_path), seed=6))
    set_autocast(model, torch.bfloat16)
    smallest_weight = min(p.numel() for p in model.parameters() if p.dim() == 2)
    prompts = [encode_prompt(tok, t, False) for t in ("17+8=", "12*3=")]  # equal lengths: no padding to build
    ids = torch.tensor(prompts)
    attn, pos = torch.ones_like(ids), torch.arange(ids.shape[1]).expand_as(ids)
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        dec = LeanDecoder(model, ids.shape[1] + 8, static=static)
        assert dec.cast == torch.bfloat16 and dec.k == [] and dec.layers[0][1].dtype == torch.bfloat16
        logits = dec.prefill(ids, attn, pos)
        casts = _Casts()
        with casts:
            for t in range(4):
                logits = dec.step(logits.argmax(-1), pos[:, -1] + 1 + t)
    assert 0 < casts.largest < smallest_weight
    assert dec.k[0].dtype == torch.bfloat16 and logits.dtype == torch.bfloat16

    params = SamplingParams(max_new_tokens=8, samples_per_prompt=2, seed=1)
    res = run(model, prompts, params, (), "static" if static else "lean")
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        for p, r in zip(prompts, res):
            for c in r:
                full = model(input_ids=torch.tensor([p + c.token_ids])).logits[0, len(p) - 1 : -1].float()
                want = torch.log_softmax(full, -1).gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]
                assert (want - torch.tensor(c.logprobs)).abs().max() < 0.05


def test_auto_decoder_is_lean_on_cpu_and_forward_where_lean_does_not_apply(tmp_path):
    from evenrl.engines.hf import _auto_decoder

    model, _ = load_policy(make_tiny_model(str(tmp_path / "m")))
    assert _auto_decoder(model) == "lean"  # static on CUDA (measured there: docs/performance.md); no CUDA here
    model.config.use_sliding_window = True  # a model LeanDecoder does not cover
    assert _auto_decoder(model) == "forward"
