"""Fixtures shared by the end-to-end tests."""

import pytest

from evenrl.demo import write_addition_data
from evenrl.models.loading import make_tiny_model


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("assets")
    model = make_tiny_model(str(root / "model"), arch="qwen2", seed=0)
    data = root / "addition.jsonl"
    write_addition_data(data)
    cfg = root / "cfg.yaml"
    cfg.write_text(f"""
model: {{path: {model}}}
data: {{path: {data}, prompts_per_step: 7, max_prompt_tokens: 16}}
rollout: {{samples_per_prompt: 3, max_new_tokens: 4, temperature: 1.0}}
rewards: {{functions: [{{name: exact_match}}, {{name: 'toy_rewards:digit_fraction', weight: 0.5}}]}}
algo: {{advantage: grpo, minibatches_per_step: 2}}
train: {{steps: 2, lr: 1.0e-3, token_cap_per_micro_batch: 24}}
log: {{progress: false, tensorboard: false, samples_every_steps: 1}}
""")
    return {"model": model, "data": data, "cfg": cfg, "root": root}
