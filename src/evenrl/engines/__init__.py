"""How samples are generated. `hf`: evenrl's keyed, KV-cached sampler on the training model."""
