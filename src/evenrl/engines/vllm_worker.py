"""What runs inside a vLLM engine's workers: methods vLLM adds to its worker class (the engine starts with
`LLM(worker_extension_cls=EXTENSION)`), called by name through `llm.collective_rpc`, so they reach a worker in this
process, in a child process (vLLM pickles the call's arguments, not the code) and every worker of an engine over
several devices alike.

    llm.collective_rpc("evenrl_reload_weights", args=(items,))           # (name, tensor) pairs, checkpoint names
    llm.collective_rpc("evenrl_reload_weights", kwargs={"path": folder})  # safetensors files in `folder`

vLLM's own `reload_weights` does the load (its checkpoint loader maps Hugging Face names onto its fused and repacked
parameters); what it leaves undone on some builds is redone here.
"""

from __future__ import annotations

EXTENSION = "evenrl.engines.vllm_worker.WorkerExtension"


class WorkerExtension:
    def evenrl_reload_weights(self, items=None, path: str | None = None) -> None:
        """Load the trainer's weights from `items` (name, tensor) or from the safetensors files in `path`."""
        if items is not None:
            self.reload_weights(weights_iterator=iter(items), is_checkpoint_format=True)
        else:
            self.reload_weights(weights_path=path, is_checkpoint_format=True)
        prepack_cpu_experts(self.model_runner.get_model())


def prepack_cpu_experts(model) -> None:
    """Redo the step vLLM 0.32's reload skips for a mixture of experts on CPU. Its first load ends each fused-experts
    layer with the experts kernel's own processing (UnquantizedFusedMoEMethod._setup_kernel calls
    fused_experts.process_weights_after_loading), which on CPU packs w13/w2 into its grouped-GEMM layout
    (CPUUnquantizedExperts: cpu_prepack_moe_weight). A reload counts as a weight update (the layer's moe_kernel
    exists) and skips that call, so the kernel read checkpoint-layout tensors as packed ones: every expert tensor
    differed from a fresh load's (up to 0.13 on a tiny Qwen3-MoE, even reloading the unchanged checkpoint from disk
    with vLLM's own loader) and log-probs were 0.06 off. Packed here, they equal a fresh load's exactly
    (benchmarks/vllm_moe_reload.py). A GPU build's unquantized experts do nothing in that step (the default
    process_weights_after_loading), so it skips nothing there."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # a vLLM without CPU experts: nothing of theirs to redo
        return
    for layer in model.modules():
        experts = getattr(getattr(getattr(layer, "quant_method", None), "moe_kernel", None), "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts):
            experts.process_weights_after_loading(layer)
