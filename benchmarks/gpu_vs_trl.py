"""evenrl vs TRL's GRPOTrainer on one GPU: benchmarks/grpo_vs_trl.py's alternating pairs (fresh process per run, seed
i for both in pair i, per-pair samples/s ratio and its median) on benchmarks/gpu.py's Qwen2.5-0.5B shape (494 M
parameters, random weights, vocabulary 151,936) and batch (16 prompts x 4 samples x 128 new tokens), both with their
own samplers, in the precision asked.

    python3 benchmarks/gpu_vs_trl.py --dtype bfloat16 --pairs 3                      # evenrl's default decoder
    python3 benchmarks/gpu_vs_trl.py --dtype bfloat16 --pairs 3 --decoder static     # its CUDA-graph decoder
    python3 benchmarks/gpu_vs_trl.py --device cpu --shape tiny --pairs 1 --steps-large 1   # this script, on CPU

Needs TRL and datasets (`pip install -e '.[bench]'`; on the offline GPU machine as wheels, ../shared/GPU.md).
Every other flag is grpo_vs_trl.py's. Not yet run on a GPU: no GPU machine was lent since it was written.
"""

from __future__ import annotations

import sys

from grpo_vs_trl import main

GPU_DEFAULTS = ["--device", "cuda", "--shape", "qwen2.5-0.5b", "--workloads", "gpu", "--nprocs", "1",
                "--out", "runs/bench_gpu_trl"]

if __name__ == "__main__":
    sys.exit(main(GPU_DEFAULTS + sys.argv[1:]))  # argparse: a flag given later wins
