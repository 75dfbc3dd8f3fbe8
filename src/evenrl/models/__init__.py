"""Hugging Face causal LMs: loading from local directories, the training forward (packed, shared-prompt and padded
paths) and the lean KV-cached decoder both the forward and the sampler build on."""
