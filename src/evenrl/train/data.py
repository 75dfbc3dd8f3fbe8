"""Prompt datasets as the trainer reads them: rows (evenrl.data.prompts) tokenized and length-filtered, and a
rank-independent sampler.

Does not import torch.
"""

from __future__ import annotations

import random

from evenrl.config import RunConfig
from evenrl.data.images import image_size
from evenrl.data.prompts import filter_by_length, load_prompts
from evenrl.errors import UsageError, bad
from evenrl.models.files import VISION_TYPES


class PromptSampler:
    """Endless stream of row indices: each epoch is a fresh permutation of range(n_rows).

    The order depends only on (seed, epoch), never on the number of ranks: the trainer draws the
    global batch here and then splits it. State is (epoch, position), so a resume continues exactly.
    """

    def __init__(self, n_rows: int, seed: int):
        if not (isinstance(n_rows, int) and n_rows >= 1):
            raise bad("n_rows", n_rows, "at least one prompt (check the dataset and the length filter)")
        self.n_rows = n_rows
        self.seed = int(seed)
        self.epoch = 0
        self.position = 0
        self._perm_epoch = -1
        self._perm: list[int] = []

    def _permutation(self, epoch: int) -> list[int]:
        if epoch != self._perm_epoch:
            # A string seed is hashed with SHA-512 by `random`, so this is stable across Python runs.
            perm = list(range(self.n_rows))
            random.Random(f"evenrl-prompts/{self.seed}/{epoch}").shuffle(perm)
            self._perm, self._perm_epoch = perm, epoch
        return self._perm

    def next_prompts(self, k: int) -> list[int]:
        """The next k row indices; an epoch boundary may fall inside the batch."""
        if k < 0:
            raise ValueError(f"next_prompts: k must be >= 0, got {k}")
        out: list[int] = []
        while len(out) < k:
            perm = self._permutation(self.epoch)
            take = min(k - len(out), self.n_rows - self.position)
            out.extend(perm[self.position : self.position + take])
            self.position += take
            if self.position == self.n_rows:
                self.epoch, self.position = self.epoch + 1, 0
        return out

    def state_dict(self) -> dict:
        return {"seed": self.seed, "n_rows": self.n_rows, "epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        if state.get("n_rows") != self.n_rows or state.get("seed") != self.seed:
            raise UsageError(
                f"resume: prompt sampler was saved for n_rows={state.get('n_rows')}, seed={state.get('seed')} "
                f"but this run has n_rows={self.n_rows}, seed={self.seed}; use the same dataset, filter and seed"
            )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not (0 <= position < self.n_rows):
            raise ValueError(f"load_state_dict: bad sampler state epoch={epoch} position={position}")
        self.epoch, self.position = epoch, position


def load_data(cfg: RunConfig, tokenizer, path: str | None = None, vision=None
              ) -> tuple[list[dict], list[list[int]], int]:
    """Prompt rows of `path` (default data.path), their token ids, and how many were skipped as too long.
    `vision`: (image processor, model config) of a vision-language model (evenrl.models.vision), which prompts
    with images need; their token ids hold each image's tokens."""
    path = cfg.data.path if path is None else path
    if not path:
        raise UsageError("data.path: empty; give a .jsonl/.parquet file, a dataset directory or a hub dataset "
                         "ORG/NAME[:CONFIG][@SPLIT]")
    rows = load_prompts(path, prompt_field=cfg.data.prompt_field, answer_field=cfg.data.answer_field,
                        extra_fields=cfg.data.extra_fields, image_key=cfg.data.image_key,
                        max_images=cfg.data.max_images_per_prompt)
    with_images = next((r for r in rows if r.get("images")), None)
    if with_images is not None and vision is None:
        raise UsageError(f"data: {path} row {with_images['id']} has images, but model.path {cfg.model.path!r} is not "
                         f"a vision-language model ({', '.join(VISION_TYPES)}); use one, or data without images")
    tokens = [encode_row(tokenizer, r, cfg.model.use_chat_template, vision) for r in rows]
    kept, skipped = filter_by_length(list(range(len(rows))), [len(t) for t in tokens], cfg.data.max_prompt_tokens)
    if not kept:
        raise UsageError(f"data.max_prompt_tokens: got {cfg.data.max_prompt_tokens}; all {len(rows)} prompts "
                         f"of {path} are longer — raise it")
    return [rows[i] for i in kept], [tokens[i] for i in kept], skipped


def take_images(rows: list[dict]) -> list[list]:
    """Each row's images (its "images" entry, removed from the row: reward functions get the row without them)."""
    return [r.pop("images", []) for r in rows]


def encode_row(tokenizer, row: dict, use_chat_template: bool, vision=None) -> list[int]:
    """Token ids of a row's prompt: text (encode_prompt), chat messages (the chat template), or a prompt with
    images (evenrl.models.vision.encode_vision_prompt, each image's placeholder expanded to its tokens)."""
    if row.get("images"):
        from evenrl.models.vision import encode_vision_prompt

        processor, config = vision
        sizes = [image_size(src) for src in row["images"]]
        return encode_vision_prompt(tokenizer, processor, config, row["prompt"], sizes, use_chat_template)
    return encode_prompt(tokenizer, row["prompt"], use_chat_template)


def encode_prompt(tokenizer, text, use_chat_template: bool) -> list[int]:
    """Token ids for one prompt.

    With `use_chat_template` and a tokenizer that has a template, the text becomes a single user
    turn followed by the generation prompt; the template supplies any BOS, so none is added again.
    Otherwise (or when the tokenizer has no template) the text is encoded as is, with the
    tokenizer's usual special tokens. Chat messages (a list) always go through the template.
    """
    if isinstance(text, list):
        if not getattr(tokenizer, "chat_template", None):
            raise UsageError("data: chat-message prompts need a chat template; the model's tokenizer has none")
        rendered = tokenizer.apply_chat_template(text, tokenize=False, add_generation_prompt=True)
        return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])
    if use_chat_template and getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])
