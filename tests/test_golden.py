"""Guard for refactors: a seeded 2-step `evenrl train` on 1 and 2 processes must end with the parameters stored in
tests/golden/two_steps.safetensors (within 1e-6).

The stored file holds the starting weights too, so the test does not depend on how transformers initialises a model;
what it pins is evenrl's arithmetic: sampling, rewards, advantages, the schedule, the exchange, the loss, KL to a
reference, two mini-batches x two epochs with the ratio clip. A change that is meant to alter the numbers regenerates
the file, and says so in its commit:

    .venv/bin/python tests/test_golden.py --write
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from e2e import evenrl, final_params, max_diff

GOLDEN = Path(__file__).resolve().parent / "golden" / "two_steps.safetensors"
TOLERANCE = 1e-6
WORLDS = (1, 2)


def _setup(root: Path) -> Path:
    from evenrl.demo import write_addition_data
    from evenrl.testing import make_tiny_model

    model = Path(make_tiny_model(str(root / "model"), arch="qwen2", hidden=16, layers=2, heads=4, seed=0))
    if GOLDEN.exists():  # the stored starting weights replace the freshly initialised ones
        start = {k[len("start."):]: v for k, v in load_file(str(GOLDEN)).items() if k.startswith("start.")}
        save_file(start, str(model / "model.safetensors"), metadata={"format": "pt"})
    data = root / "addition.jsonl"
    write_addition_data(data)
    cfg = root / "golden.yaml"
    cfg.write_text(f"""
model: {{path: {model}}}
data: {{path: {data}, prompts_per_step: 5, max_prompt_tokens: 16, seed: 3}}
rollout: {{samples_per_prompt: 3, max_new_tokens: 5, temperature: 1.0}}
rewards: {{functions: [{{name: exact_match}}, {{name: 'toy_rewards:digit_fraction', weight: 0.5}}], isolate: false}}
algo: {{advantage: grpo, minibatches_per_step: 2, epochs_per_step: 2, kl_coef: 0.05, clip_high: 0.28}}
train: {{steps: 2, lr: 3.0e-3, token_cap_per_micro_batch: 24, seed: 7}}
log: {{progress: false, tensorboard: false, samples_every_steps: 0}}
""")
    return cfg


def _train(cfg: Path, run_dir: Path, world: int) -> dict[str, torch.Tensor]:
    evenrl("train", cfg, f"log.run_dir={run_dir}", "--nproc-per-node", world)
    return final_params(run_dir)


@pytest.mark.slow
@pytest.mark.parametrize("world", WORLDS)
def test_two_seeded_steps_match_the_golden_parameters(tmp_path, world):
    golden = load_file(str(GOLDEN))
    got = _train(_setup(tmp_path), tmp_path / "run", world)
    want = {k[len(f"w{world}."):]: v for k, v in golden.items() if k.startswith(f"w{world}.")}
    start = {k[len("start."):]: v for k, v in golden.items() if k.startswith("start.")}
    assert max_diff(want, start) > 1e-4, "the golden run did not move the model: weak test"
    diff = max_diff(want, got)
    assert diff <= TOLERANCE, f"final parameters moved by {diff:.3g} from the golden run on {world} process(es)"


def _write(root: Path) -> None:
    cfg = _setup(root)
    start = load_file(str(root / "model" / "model.safetensors"))
    out = {f"start.{k}": v.contiguous() for k, v in start.items()}
    for w in WORLDS:
        out.update({f"w{w}.{k}": v.contiguous() for k, v in _train(cfg, root / f"w{w}", w).items()})
    GOLDEN.parent.mkdir(exist_ok=True)
    save_file(out, str(GOLDEN))
    print(f"wrote {GOLDEN}: {len(out)} tensors; 1 vs 2 processes differ by "
          f"{max_diff(*[{k.split('.', 1)[1]: v for k, v in out.items() if k.startswith(f'w{w}.')} for w in WORLDS]):.3g}")


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/test_golden.py --write")
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        _write(Path(d))
