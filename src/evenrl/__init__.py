"""evenrl: RL post-training of language models where the layout is planned, not guessed.

Importing the package is cheap and does not import torch; `evenrl plan` relies on that.
"""

__version__ = "0.1.0"
