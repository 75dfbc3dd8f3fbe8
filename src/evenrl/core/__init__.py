"""The exact core: pure functions and the data they pass around, no I/O, no process groups.

batch (the step's per-sample columns), partition and schedule (who runs which sample; torch-free), aggregation
(global denominators), advantages and losses (each tested against a naive loop). Imports nothing of evenrl but
`errors`.
"""
