"""DecodeStep: the steps of a static LeanDecoder from fixed input buffers; on CUDA replayed from one captured graph.

A decode step of a small model at a few dozen rows is bound by kernel launches and Python, not by the GPU: the
0.5B-shaped model spent ~18 ms per token on one H100 (docs/performance.md), where reading its weights takes ~0.4 ms.
A CUDA graph replays all of a step's kernels with one launch. The capture needs every shape and address of the step
fixed and no value read back to the host, which LeanDecoder(static=True) provides (tested on CPU by compiling its
step whole, tests/test_rollout.py). The graph itself only exists on CUDA; it has not yet run on a GPU machine.
"""

from __future__ import annotations

import torch


class DecodeStep:
    """Calls dec.step(tok, pos) for the rows' sampled tokens, advancing pos itself; returns the next logits. On CUDA
    the first call runs the step eagerly (the warm-up a capture needs, on a side stream) and captures the next one;
    later calls copy the tokens into the captured input and replay. The logits a replay returns are overwritten by
    the next replay: use them before calling again."""

    def __init__(self, dec, pos: torch.Tensor):
        if not dec.static:
            raise ValueError("DecodeStep needs a LeanDecoder(static=True): a graph replays fixed shapes")
        self.dec, self.pos = dec, pos.clone()
        self.graphed = pos.device.type == "cuda"
        self.graph = None
        self.tok = None
        self.out = None

    def __call__(self, tok: torch.Tensor) -> torch.Tensor:
        if not self.graphed:
            return self._advance(tok)
        if self.graph is None:
            self.tok = tok.clone()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                logits = self._advance(self.tok)
            torch.cuda.current_stream().wait_stream(side)
            # Capturing records the next step without running it: the cache, length and positions stay as the
            # warm-up left them until the first replay.
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.out = self._advance(self.tok)
            return logits
        self.tok.copy_(tok)
        self.graph.replay()
        return self.out

    def _advance(self, tok):
        logits = self.dec.step(tok, self.pos)
        self.pos.add_(1)
        return logits
