"""`evenrl plan`: the preflight planner. Reads a config (or a peer framework's), a cluster layout and a model's
config.json, and lists every finding at once. Never imports torch (a test enforces it), so it runs in well under a
second on any machine.
"""
