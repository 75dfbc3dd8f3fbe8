"""What the launcher's fork server imports once before it forks the workers (evenrl.train.launch): the training
loop with torch, and transformers' model classes for the common families, which transformers imports lazily on the
first `AutoModelForCausalLM.from_pretrained` (~1 s of a core). Another family is imported by the worker that
loads it."""

try:
    import transformers
    from transformers.models.llama import modeling_llama  # noqa: F401
    from transformers.models.qwen2 import modeling_qwen2  # noqa: F401

    import evenrl.train.loop  # noqa: F401

    transformers.AutoModelForCausalLM, transformers.AutoTokenizer  # noqa: B018  (resolves the lazy modules)
except Exception:  # noqa: BLE001
    # multiprocessing's fork server dies on any error but ImportError in a preload, and every worker with it; a
    # worker imports what it needs itself and reports its own error
    pass
