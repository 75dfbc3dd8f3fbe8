"""The prompt dataset, read and checked without torch: .jsonl lines, parquet and Arrow columns, rows.

    rows, complete = read_rows("data/train.jsonl", Fields("prompt", "answer"))
    rows, complete = read_rows("hiyouga/geometry3k@train", Fields("problem", "answer"))   # from the HF cache

A hub dataset id is read from the Arrow files of its split in the `datasets` cache (evenrl.data.hub).

The trainer reads through these functions (evenrl.train.data) and `evenrl plan` reads the first rows the same way
(evenrl.planner.rules), so the plan never calls runnable what the trainer refuses. Every problem is a one-line
UsageError that names the file (and line or row) and what is wrong, raised before the trainer writes anything.
Pure Python (json; pyarrow only for parquet and Arrow files): never imports torch.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from evenrl.data import hub
from evenrl.data.images import IMAGE_PLACEHOLDER, check_image, image_sources, message_images
from evenrl.errors import UsageError, bad, first_line

JSON_MAX_BYTES = 16 * 1024**2  # a JSON file read whole (a dataset's state.json, a model's config.json)
RESERVED = ("prompt", "answer", "id", "images")
DATA_SUFFIXES = (".jsonl", ".parquet")
HF_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")


@dataclass(frozen=True)
class Fields:
    """Which columns become a row: data.prompt_field, data.answer_field (None: no answers), data.extra_fields,
    data.image_key (None: no image column)."""

    prompt: str = "prompt"
    answer: str | None = "answer"
    extra: tuple[str, ...] = ()
    image: str | None = None
    max_images: int = 0  # data.max_images_per_prompt; 0: no limit

    def __post_init__(self):
        for f in self.extra:
            if f in RESERVED:
                raise bad("extra_fields", f, f"names other than {', '.join(RESERVED)} (those are always present)")

    def columns(self) -> list[str]:
        return ([self.prompt] + ([self.answer] if self.answer is not None else []) + list(self.extra)
                + ([self.image] if self.image else []))

    def role(self, column: str) -> str:
        return ("prompt_field" if column == self.prompt else "answer_field" if column == self.answer
                else "image_key" if column == self.image else "extra_fields")


def dataset_sources(path: str) -> list[tuple[str, str]]:
    """(source, kind) pairs a dataset path stands for, in reading order: kind "jsonl" or "parquet" for files,
    "arrow" for a directory written by datasets' save_to_disk (its train split for a DatasetDict), "hub" for a hub
    dataset id (its split's Arrow files in the `datasets` cache, one table: evenrl.data.hub)."""
    path = os.fspath(path)
    if hub.parse(path) is not None:
        return [(path, "hub")]
    if not os.path.exists(path):
        raise bad("prompts path", path, "expected an existing .jsonl or .parquet file, a dataset directory or a "
                                        "Hugging Face dataset id (ORG/NAME[:CONFIG][@SPLIT])")
    if not os.path.isdir(path):
        return [(path, _file_kind(path))]
    names = sorted(os.listdir(path))
    if any(n in names for n in HF_MARKERS):
        return [(_hf_split(path), "arrow")]
    files = [os.path.join(path, n) for n in names if n.endswith(DATA_SUFFIXES) and os.path.isfile(os.path.join(path, n))]
    if not files:
        raise bad("prompts path", path, "a directory holding .jsonl/.parquet files or a dataset saved with save_to_disk")
    return [(f, _file_kind(f)) for f in files]


def _file_kind(path: str) -> str:
    for suffix in DATA_SUFFIXES:
        if path.endswith(suffix):
            return suffix[1:]
    raise bad("prompts path", path, "expected a .jsonl or .parquet file or a dataset directory")


def _hf_split(path: str) -> str:
    dd = os.path.join(path, "dataset_dict.json")
    if not os.path.exists(dd):
        return path
    doc = read_json(Path(dd), "a save_to_disk DatasetDict ({\"splits\": [...]})")
    splits = doc.get("splits") if isinstance(doc, dict) else None
    if not isinstance(splits, list):
        raise UsageError(f"{dd}: no \"splits\" list; expected a dataset written by save_to_disk")
    if "train" not in splits:
        raise bad("prompts path", path, f"a dataset or a DatasetDict with a 'train' split (splits: "
                                        f"{', '.join(map(str, splits))})")
    return os.path.join(path, "train")


def iter_jsonl(path: str, max_bytes: int | None = None) -> Iterator[tuple[int, dict]]:
    """(line number, object) for each non-blank line; a line that is not JSON or not a JSON object is a
    UsageError naming the file and line. Stops after `max_bytes` (the planner's budget) when given."""
    seen = 0
    try:
        with open(path, "rb") as f:
            for n, raw in enumerate(f, 1):
                seen += len(raw)
                if max_bytes is not None and seen > max_bytes:
                    return
                if not raw.strip():
                    continue
                try:
                    rec = json.loads(raw.decode("utf-8"))
                except UnicodeDecodeError:
                    raise UsageError(f"{path} line {n}: not UTF-8 text; expected one JSON object per line") from None
                except json.JSONDecodeError as e:
                    raise UsageError(f"{path} line {n}: not valid JSON ({e.msg}); expected one JSON object per "
                                     "line") from None
                if not isinstance(rec, dict):
                    raise UsageError(f"{path} line {n}: a JSON {_json_kind(rec)}; expected a JSON object per line "
                                     "(e.g. {\"prompt\": ..., \"answer\": ...})")
                yield n, rec
    except OSError as e:
        raise UsageError(f"{path}: cannot read ({e.__class__.__name__}); expected a .jsonl file") from None


def _json_kind(v: Any) -> str:
    return {list: "list", str: "string", bool: "boolean", int: "number", float: "number"}.get(type(v), "null")


def check_columns(columns: list[str], src: str, fields: Fields) -> None:
    """A table's column names hold every field the run reads."""
    for col in fields.columns():
        if col not in columns:
            raise UsageError(f"{src}: no column {col!r} (data.{fields.role(col)}); columns are {_names(columns)}")


def check_prompt_type(arrow_type, src: str, fields: Fields) -> None:
    """The prompt column of a parquet/Arrow table holds text (or lists: chat messages, checked row by row)."""
    import pyarrow as pa

    if not (pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type)
            or getattr(pa.types, "is_string_view", lambda t: False)(arrow_type)
            or pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type)):
        raise UsageError(f"{src}: column {fields.prompt!r} (data.prompt_field) holds {arrow_type}; expected text "
                         "or chat messages")


def parquet_schema(path: str):
    import pyarrow.parquet as pq

    try:
        return pq.read_schema(path)
    except Exception as e:  # pyarrow raises several unrelated types for corrupt files
        raise UsageError(f"{path}: could not read parquet ({first_line(e)})") from None


def read_parquet(path: str, fields: Fields, max_rows: int | None = None) -> list[dict]:
    """Rows of a parquet file, its schema checked first; with max_rows, only the first ones (cheap)."""
    import pyarrow.parquet as pq

    schema = parquet_schema(path)
    check_columns(schema.names, path, fields)
    check_prompt_type(schema.field(fields.prompt).type, path, fields)
    try:
        if max_rows is None:
            return pq.read_table(path, columns=fields.columns()).to_pylist()
        f = pq.ParquetFile(path)
        batch = next(f.iter_batches(batch_size=max_rows, columns=fields.columns()), None)
        return batch.to_pylist() if batch is not None else []
    except Exception as e:
        raise UsageError(f"{path}: could not read parquet ({first_line(e)})") from None


def read_arrow_dir(path: str, fields: Fields, max_rows: int | None = None) -> list[dict]:
    """A directory written by `datasets` save_to_disk, read with pyarrow alone (no `datasets` dependency):
    `state.json` lists the split's Arrow stream files."""
    state = Path(path) / "state.json"
    doc = read_json(state, "a save_to_disk state ({\"_data_files\": [{\"filename\": ...}]})") \
        if state.is_file() else None
    try:
        files = [d["filename"] for d in doc["_data_files"]]
        if not all(isinstance(f, str) for f in files):
            raise TypeError("filename is not a string")
    except (TypeError, KeyError):
        raise UsageError(f"prompts path: {path!r} is not a readable save_to_disk dataset (state.json lists no "
                         "\"_data_files\")") from None
    return read_arrow_files([os.path.join(path, name) for name in files], fields, max_rows,
                            f"prompts path: {path!r} is not a readable save_to_disk dataset")


def read_arrow_files(files: list[str], fields: Fields, max_rows: int | None = None,
                     unreadable: str = "") -> list[dict]:
    """Rows of Arrow stream files (as `datasets` writes them), each schema checked first; with max_rows, only the
    first ones. A file pyarrow cannot read is a UsageError: `unreadable` (default: the file's name) and why."""
    import pyarrow as pa

    rows: list = []
    for name in files:
        try:
            with pa.memory_map(name) as source:
                reader = pa.ipc.open_stream(source)
                check_columns(reader.schema.names, name, fields)
                check_prompt_type(reader.schema.field(fields.prompt).type, name, fields)
                if max_rows is None:
                    rows.extend(reader.read_all().to_pylist())
                    continue
                for batch in reader:
                    rows.extend(batch.to_pylist()[: max_rows - len(rows)])
                    if len(rows) >= max_rows:
                        return rows
        except (OSError, ValueError, pa.ArrowInvalid) as e:
            raise UsageError(f"{unreadable or f'{name}: not a readable Arrow file'} "
                             f"({type(e).__name__}: {first_line(e)})") from None
    return rows


def make_row(rec: Any, where: str, row_id: int, fields: Fields, base_dir: str = ".") -> dict:
    """`{"prompt": str or messages, "answer": ..., "id": row_id, **extra}` from one record, plus "images" (encoded
    bytes or absolute paths, in the order the prompt shows them) when the row has any; a missing field, a prompt
    that is neither text nor chat messages, or images that do not match the prompt's image slots is a
    UsageError naming `where` (file and line or row)."""
    if not isinstance(rec, dict):
        raise UsageError(f"{where}: got {type(rec).__name__}; expected an object with a {fields.prompt!r} field")
    if fields.prompt not in rec:
        raise UsageError(f"{where}: no field {fields.prompt!r} (prompt_field); fields are {_names(rec)}")
    prompt = rec[fields.prompt]
    carried: list = []
    if isinstance(prompt, list):  # chat messages, whose image parts may carry their images
        prompt, carried = message_images(prompt, where, base_dir)
    elif not isinstance(prompt, str):
        raise UsageError(f"{where}: field {fields.prompt!r} is {type(prompt).__name__}; expected a string or a "
                         "list of chat messages")
    row = {"prompt": prompt, "answer": None, "id": row_id}
    if fields.answer is not None:
        if fields.answer not in rec:
            raise UsageError(f"{where}: no field {fields.answer!r} (answer_field); fields are {_names(rec)}")
        row["answer"] = rec[fields.answer]
    for f in fields.extra:
        if f not in rec:
            raise UsageError(f"{where}: no field {f!r} (extra_fields); fields are {_names(rec)}")
        row[f] = rec[f]
    column: list = []
    if fields.image:
        if fields.image not in rec:
            raise UsageError(f"{where}: no field {fields.image!r} (data.image_key); fields are {_names(rec)}")
        if rec[fields.image] is not None:
            column = image_sources(rec[fields.image], where, base_dir)
    images = _placed(prompt, carried, column, where, fields)
    if fields.max_images and len(images) > fields.max_images:
        raise UsageError(f"{where}: {len(images)} images, more than data.max_images_per_prompt="
                         f"{fields.max_images}; raise it or drop the row")
    if images:
        row["images"] = images
    return row


def _placed(prompt, carried: list, column: list, where: str, fields: Fields) -> list:
    """The row's images in prompt order: image parts that carry their own, bare ones filled from the image column
    in order; a text prompt takes the column at its <image> placeholders, or all first when it has none."""
    slots = len(carried) if isinstance(prompt, list) else prompt.count(IMAGE_PLACEHOLDER)
    bare = sum(1 for c in carried if c is None) if isinstance(prompt, list) else slots
    if column and bare != len(column) and not (slots == 0 and not isinstance(prompt, list)):
        what = "bare image parts" if isinstance(prompt, list) else f"{IMAGE_PLACEHOLDER} placeholders"
        raise UsageError(f"{where}: the prompt has {bare} {what} but {fields.image!r} (data.image_key) holds "
                         f"{len(column)} images; give one image per slot")
    if bare and not column and (fields.image or isinstance(prompt, list)):
        raise UsageError(f"{where}: the prompt has {bare} image slot(s) without an image; "
                         + ("set data.image_key to the image column" if not fields.image
                            else f"{fields.image!r} (data.image_key) is empty"))
    if not isinstance(prompt, list):
        return list(column)
    fill = iter(column)
    return [c if c is not None else next(fill) for c in carried]


def read_rows(path: str, fields: Fields, *, max_bytes: int | None = None, max_rows: int | None = None,
              image_rows: int | None = None) -> tuple[list[dict], bool]:
    """Rows of a dataset path (see dataset_sources) and whether that was all of them. With max_bytes / max_rows
    (the planner), each .jsonl file is read up to max_bytes and each table up to its first max_rows rows, every
    one checked as the trainer checks it; without them, everything. Every image of the first `image_rows` rows
    (None: of all) is decoded once (evenrl.data.images.check_image)."""
    rows: list[dict] = []
    complete = True

    def add(rec: Any, where: str, src: str) -> None:
        row = make_row(rec, where, len(rows), fields, os.path.dirname(os.path.abspath(src)))
        if image_rows is None or len(rows) < image_rows:
            for image in row.get("images", ()):
                check_image(image, where)
        rows.append(row)

    for src, kind in dataset_sources(path):
        if kind == "jsonl":
            size = os.path.getsize(src)
            complete &= max_bytes is None or size <= max_bytes
            for n, rec in iter_jsonl(src, max_bytes):
                add(rec, f"{src} line {n}", src)
            continue
        if kind == "parquet":
            records = read_parquet(src, fields, max_rows)
        elif kind == "hub":
            records = read_arrow_files(hub.cached_files(hub.parse(src), "prompts path"), fields, max_rows)
        else:
            records = read_arrow_dir(src, fields, max_rows)
        complete &= max_rows is None or len(records) < max_rows
        for i, rec in enumerate(records):
            add(rec, f"{src} row {i}", src)
    if complete and not rows:
        raise UsageError(f"prompts path: {path!r} has no rows; expected at least one prompt")
    return rows, complete


def _names(cols) -> str:
    names = ", ".join(sorted(map(str, cols)))
    return names if len(names) <= 120 else names[:117] + "..."


def read_json(f: Path, what: str, max_bytes: int = JSON_MAX_BYTES) -> Any:
    """A JSON file's contents, at most `max_bytes` of them; a missing, unreadable, larger or invalid file is a
    one-line UsageError naming the file and `what` was expected there."""
    try:
        if f.stat().st_size > max_bytes:
            raise UsageError(f"{f}: larger than {max_bytes:,} bytes; expected {what}")
        return json.loads(f.read_text(encoding="utf-8"))
    except OSError as e:
        raise UsageError(f"{f}: cannot read ({e.__class__.__name__}); expected {what}") from None
    except UnicodeDecodeError:
        raise UsageError(f"{f}: not UTF-8 text; expected {what}") from None
    except json.JSONDecodeError as e:
        raise UsageError(f"{f}: not valid JSON ({e.msg} at line {e.lineno}); expected {what}") from None
