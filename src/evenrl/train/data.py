"""Prompt datasets: loading rows from local files, length filtering, and a rank-independent sampler.

Does not import torch.
"""

from __future__ import annotations

import json
import os
import random

from evenrl.config import RunConfig
from evenrl.errors import UsageError, bad

_RESERVED = ("prompt", "answer", "id")
_FILE_KINDS = (".jsonl", ".parquet")


def load_prompts(
    path: str,
    *,
    prompt_field: str = "prompt",
    answer_field: str | None = "answer",
    extra_fields: list[str] | None = None,
) -> list[dict]:
    """Rows `{"prompt": str, "answer": ..., "id": int, **extra}` from a local dataset.

    `path` is a .jsonl or .parquet file, a directory of such files (read in sorted name order), or
    a directory written by `datasets.Dataset.save_to_disk` (read with pyarrow; a DatasetDict must have a
    "train" split). `id` is the row's index in that order, stable across
    runs. Answers are kept as stored (a number stays a number); `answer_field=None` means no answers.
    """
    path = os.fspath(path)
    extra_fields = list(extra_fields or [])
    for f in extra_fields:
        if f in _RESERVED:
            raise bad("extra_fields", f, f"names other than {', '.join(_RESERVED)} (those are always present)")
    if not os.path.exists(path):
        raise bad("prompts path", path, "expected an existing .jsonl or .parquet file or a dataset directory")

    if os.path.isdir(path):
        sources = _read_dir(path)
    else:
        sources = [(path, _read_file(path))]

    rows: list[dict] = []
    for src, records in sources:
        for i, rec in enumerate(records):
            rows.append(_make_row(rec, src, i, len(rows), prompt_field, answer_field, extra_fields))
    if not rows:
        raise UsageError(f"prompts path: {path!r} has no rows; expected at least one prompt")
    return rows


def _make_row(rec, src, i, row_id, prompt_field, answer_field, extra_fields) -> dict:
    where = f"{src} row {i}"
    if not isinstance(rec, dict):
        raise UsageError(f"{where}: got {type(rec).__name__}; expected an object with a {prompt_field!r} field")
    if prompt_field not in rec:
        raise UsageError(f"{where}: no field {prompt_field!r} (prompt_field); fields are {_names(rec)}")
    prompt = rec[prompt_field]
    if not isinstance(prompt, str):
        raise UsageError(f"{where}: field {prompt_field!r} is {type(prompt).__name__}; expected a string")
    row = {"prompt": prompt, "answer": None, "id": row_id}
    if answer_field is not None:
        if answer_field not in rec:
            raise UsageError(f"{where}: no field {answer_field!r} (answer_field); fields are {_names(rec)}")
        row["answer"] = rec[answer_field]
    for f in extra_fields:
        if f not in rec:
            raise UsageError(f"{where}: no field {f!r} (extra_fields); fields are {_names(rec)}")
        row[f] = rec[f]
    return row


def _names(rec: dict) -> str:
    names = ", ".join(sorted(map(str, rec)))
    return names if len(names) <= 120 else names[:117] + "..."


def _read_file(path: str) -> list:
    if path.endswith(".jsonl"):
        return _read_jsonl(path)
    if path.endswith(".parquet"):
        return _read_parquet(path)
    raise bad("prompts path", path, "expected a .jsonl or .parquet file or a dataset directory")


def _read_jsonl(path: str) -> list:
    out = []
    try:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise UsageError(f"{path} line {n}: not valid JSON ({e.msg}); expected one JSON object per line") from None
    except UnicodeDecodeError:
        raise UsageError(f"{path}: not UTF-8 text; expected a .jsonl file") from None
    return out


def _read_parquet(path: str) -> list:
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path).to_pylist()
    except Exception as e:  # pyarrow raises several unrelated types for corrupt files
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UsageError(f"{path}: could not read parquet ({msg})") from None


def _read_dir(path: str) -> list[tuple[str, list]]:
    names = sorted(os.listdir(path))
    if any(n in names for n in ("dataset_info.json", "state.json", "dataset_dict.json")):
        return [(path, _read_hf_dataset(path))]
    files = [os.path.join(path, n) for n in names if n.endswith(_FILE_KINDS) and os.path.isfile(os.path.join(path, n))]
    if not files:
        raise bad("prompts path", path, "a directory holding .jsonl/.parquet files or a dataset saved with save_to_disk")
    return [(f, _read_file(f)) for f in files]


def _read_hf_dataset(path: str) -> list:
    """A directory written by `datasets` save_to_disk, read with pyarrow alone (no `datasets` dependency):
    `state.json` lists the split's Arrow stream files; a DatasetDict has `dataset_dict.json` and one
    sub-directory per split, of which "train" is used."""
    import json

    import pyarrow as pa

    if os.path.exists(os.path.join(path, "dataset_dict.json")):
        with open(os.path.join(path, "dataset_dict.json")) as f:
            splits = json.load(f).get("splits", [])
        if "train" not in splits:
            raise bad("prompts path", path, f"a dataset or a DatasetDict with a 'train' split (splits: {', '.join(splits)})")
        path = os.path.join(path, "train")
    try:
        with open(os.path.join(path, "state.json")) as f:
            files = [d["filename"] for d in json.load(f)["_data_files"]]
        rows: list = []
        for name in files:
            with pa.memory_map(os.path.join(path, name)) as source:
                rows.extend(pa.ipc.open_stream(source).read_all().to_pylist())
    except (OSError, KeyError, ValueError, TypeError, pa.ArrowInvalid) as e:
        raise UsageError(f"prompts path: {path!r} is not a readable save_to_disk dataset "
                         f"({type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''})") from None
    return rows


def filter_by_length(rows: list[dict], token_counts: list[int], max_prompt_tokens: int) -> tuple[list[dict], int]:
    """Keep rows whose prompt has at most `max_prompt_tokens` tokens; return (kept, skipped_count).

    Long prompts are skipped, never truncated: a cut prompt asks a different question.
    """
    if len(rows) != len(token_counts):
        raise ValueError(f"filter_by_length: {len(rows)} rows but {len(token_counts)} token counts")
    kept = [r for r, n in zip(rows, token_counts) if n <= max_prompt_tokens]
    return kept, len(rows) - len(kept)


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


def load_data(cfg: RunConfig, tokenizer, path: str | None = None) -> tuple[list[dict], list[list[int]], int]:
    """Prompt rows of `path` (default data.path), their token ids, and how many were skipped as too long."""
    path = cfg.data.path if path is None else path
    if not path:
        raise UsageError("data.path: empty; give a .jsonl/.parquet file or a dataset directory")
    rows = load_prompts(path, prompt_field=cfg.data.prompt_field, answer_field=cfg.data.answer_field,
                        extra_fields=cfg.data.extra_fields)
    tokens = [encode_prompt(tokenizer, r["prompt"], cfg.model.use_chat_template) for r in rows]
    kept, skipped = filter_by_length(list(range(len(rows))), [len(t) for t in tokens], cfg.data.max_prompt_tokens)
    if not kept:
        raise UsageError(f"data.max_prompt_tokens: got {cfg.data.max_prompt_tokens}; all {len(rows)} prompts "
                         f"of {path} are longer — raise it")
    return [rows[i] for i in kept], [tokens[i] for i in kept], skipped


def encode_prompt(tokenizer, text: str, use_chat_template: bool) -> list[int]:
    """Token ids for one prompt.

    With `use_chat_template` and a tokenizer that has a template, the text becomes a single user
    turn followed by the generation prompt; the template supplies any BOS, so none is added again.
    Otherwise (or when the tokenizer has no template) the text is encoded as is, with the
    tokenizer's usual special tokens.
    """
    if use_chat_template and getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])
