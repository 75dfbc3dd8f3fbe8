"""The rollout side of a step (docs/architecture.md): the samples a step trains on, made where the engine runs.

- source: `TrajectorySource`, the one trajectory-loop protocol (load, generate, advance) that rollout.env's turn loop
  and rollout.agent's agents (evenrl.agents.rollout.Agents) both satisfy.
- trajectories: rollout.env's turn loop (`Turns`), its columns, and `make_turns` (the run's trajectory loop).
- generate: a training rank's share of the step's samples as its rows.
- carry, talk, carry_check: partial rollouts (rollout.partial): samples carried across steps, a trajectory's turn
  loop state kept on the sample, a checkpoint's carried samples checked.

Rewards, advantages and everything after them are train/'s (the gradient side); a reserved rollout rank's whole run
(train/rollout_rank.py) stays there too: it reads the trainers' checkpoints and builds the engine's model.
Nothing here imports train/ (tests/test_architecture.py): what a step's function reads of the trainer it reads by
field.
"""
