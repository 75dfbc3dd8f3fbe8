"""Prompt rows from a dataset and their length filter: what the trainer's prompt loading (evenrl.train.data) and the
trajectory loops' openings (evenrl.rollout.trajectories) both read through. Torch-free.
"""

from __future__ import annotations

import os

from evenrl.data.readers import Fields, read_rows


def load_prompts(
    path: str,
    *,
    prompt_field: str = "prompt",
    answer_field: str | None = "answer",
    extra_fields: list[str] | None = None,
    image_key: str | None = None,
    max_images: int = 0,
) -> list[dict]:
    """Rows `{"prompt": str, "answer": ..., "id": int, **extra}` from a local dataset; a row with images also
    holds "images" (encoded bytes or absolute paths, evenrl.data.images), and a chat-message prompt is a list of
    messages.

    `path` is a .jsonl or .parquet file, a directory of such files (read in sorted name order),
    a directory written by `datasets.Dataset.save_to_disk` (read with pyarrow; a DatasetDict must have a
    "train" split), or a hub dataset ORG/NAME[:CONFIG][@SPLIT] in the datasets cache (evenrl.data.hub; the
    launcher downloads it). `id` is the row's index in that order, stable across
    runs. Answers are kept as stored (a number stays a number); `answer_field=None` means no answers.
    Reading and checking is evenrl.data.readers.read_rows, which `evenrl plan` runs on the first rows too:
    a line that is not a JSON object, a missing column or field is a one-line UsageError naming the file.
    """
    fields = Fields(prompt_field, answer_field, tuple(extra_fields or ()), image_key or None, max_images)
    rows, _ = read_rows(os.fspath(path), fields)
    return rows


def filter_by_length(rows: list[dict], token_counts: list[int], max_prompt_tokens: int) -> tuple[list[dict], int]:
    """Keep rows whose prompt has at most `max_prompt_tokens` tokens; return (kept, skipped_count).

    Long prompts are skipped, never truncated: a cut prompt asks a different question.
    """
    if len(rows) != len(token_counts):
        raise ValueError(f"filter_by_length: {len(rows)} rows but {len(token_counts)} token counts")
    kept = [r for r, n in zip(rows, token_counts) if n <= max_prompt_tokens]
    return kept, len(rows) - len(kept)
