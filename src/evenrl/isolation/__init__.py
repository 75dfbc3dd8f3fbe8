"""Running code evenrl does not trust with limits: contained calls in worker processes (pool) for rewards and
environments, and model-written code in a process of its own (code) for the python tool. docs/rewards.md and
docs/multiturn.md say what each limit holds and what it does not."""
