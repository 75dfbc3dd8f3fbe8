"""python -m evenrl.config: print the annotated default config (docs/config.md is this output)."""

from evenrl.config.reference import describe

print(describe())
