"""`evenrl train` and `evenrl sft`: the RL step (`step.rl_step`), the loop and set-up (`loop`), the gradient step
(`update`), data, evaluation, checkpoints, the run log and the launcher."""
