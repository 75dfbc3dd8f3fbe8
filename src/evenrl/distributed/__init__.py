"""Everything that crosses processes: the launch environment and the collectives. Collectives live in
`collectives` only; with one process they are no-ops, so 1 and N ranks run the same code. This package's
__init__ imports nothing, so the torch-free planner can read the environment."""
