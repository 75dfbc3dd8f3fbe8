"""The local files a run reads before anything is loaded, checked without torch or transformers: the model
directory (config.json, model_type, weights, tokenizer files) and the prompt dataset (.jsonl lines, parquet
and Arrow columns, rows).

The trainer reads through these functions (evenrl.models.loading.load_policy, evenrl.train.data) and
`evenrl plan` runs the same checks (evenrl.planner.rules), so the plan never calls runnable what the trainer
refuses. Every problem is a one-line UsageError that names the file and what is wrong, raised before the
trainer writes anything. Pure Python (json, struct; pyarrow only for parquet and Arrow files): never imports
torch.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from evenrl.errors import UsageError, bad, first_line

# ------------------------------------------------------------------------------------------ the model directory

CONFIG_MAX_BYTES = 16 * 1024**2  # config.json, vocab.json and a safetensors header are read whole
TOKENIZER_MAX_BYTES = 512 * 1024**2  # tokenizer.json too, but large vocabularies (Gemma's) run to tens of MB
SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
PICKLE_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json")
# Files a tokenizer's vocabulary lives in (transformers' VOCAB_FILES_NAMES across its tokenizers).
VOCAB_FILES = ("tokenizer.json", "vocab.json", "vocab.txt", "tokenizer.model", "spiece.model",
               "sentencepiece.bpe.model", "sentencepiece.model", "spm.model", "spm_char.model")
VOCAB_SUFFIXES = (".tiktoken", ".spm")
# Bytes per element of safetensors dtypes (sub-byte and unknown ones are not size-checked).
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8,
                "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1}
_REDOWNLOAD = "re-download the model or save it again with save_pretrained"


def model_dir(path: str) -> Path:
    """The model directory as a Path; a missing one is a UsageError (evenrl never downloads)."""
    p = Path(path).expanduser()
    if not path or not p.is_dir():
        raise bad("model.path", path, "expected a local directory with config.json (a model saved with "
                                      "save_pretrained); evenrl never downloads")
    return p


def read_model_config(path: str) -> dict:
    """config.json of the model directory, checked: a JSON object whose model_type is a causal LM this
    transformers can build (when its table of them can be read)."""
    d = model_dir(path)
    f = d / "config.json"
    if not f.is_file():
        raise UsageError(f"{d}: no config.json; expected a Hugging Face model directory (written by save_pretrained)")
    cfg = _read_json(f, "the model's Hugging Face config")
    if not isinstance(cfg, dict):
        raise UsageError(f"{f}: top level is a {type(cfg).__name__}; expected a JSON object (the model's config)")
    kind = cfg.get("model_type")
    if not isinstance(kind, str) or not kind:
        raise UsageError(f"{f}: no \"model_type\"; expected a Hugging Face config with one, e.g. \"qwen2\" or "
                         "\"llama\"")
    known = causal_lm_types()
    if known is not None and kind not in known:
        raise UsageError(f"{f}: model_type {kind!r} is not a causal LM that transformers {_version()} can load; "
                         "use a decoder-only model (e.g. qwen2, llama) or a transformers that knows it")
    return cfg


def check_weights(path: str) -> None:
    """The weights transformers would load exist and, for safetensors, are complete: every tensor the header
    describes lies inside the file and the file ends where the last one does (an empty or truncated download
    fails here, not half-way through loading)."""
    d = model_dir(path)
    if (d / SAFE_WEIGHTS).exists():
        check_safetensors(d / SAFE_WEIGHTS)
        return
    if (d / SAFE_INDEX).exists():
        index = _read_json(d / SAFE_INDEX, "a safetensors index ({\"weight_map\": {tensor: file}})")
        shards = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(shards, dict) or not shards or not all(isinstance(v, str) for v in shards.values()):
            raise UsageError(f"{d / SAFE_INDEX}: no \"weight_map\" of tensor names to shard files; {_REDOWNLOAD}")
        for name in sorted(set(shards.values())):
            shard = d / name
            if Path(name).name != name or not shard.is_file():
                raise UsageError(f"{shard}: listed in {SAFE_INDEX} but missing; {_REDOWNLOAD}")
            check_safetensors(shard)
        return
    for name in PICKLE_WEIGHTS:
        if (d / name).is_file():
            if (d / name).stat().st_size == 0:
                raise UsageError(f"{d / name}: empty (0 bytes); {_REDOWNLOAD}")
            return
    raise UsageError(f"{d}: no weights ({SAFE_WEIGHTS}, {SAFE_INDEX} or {PICKLE_WEIGHTS[0]}); {_REDOWNLOAD}")


def check_safetensors(f: Path) -> None:
    """A safetensors file whose header (8-byte length, then JSON) describes exactly the bytes that follow."""
    try:
        size = f.stat().st_size
        with f.open("rb") as fh:
            head = fh.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else None
            if n is None or n > min(size - 8, CONFIG_MAX_BYTES):
                what = "empty (0 bytes)" if size == 0 else f"not a safetensors file or truncated ({size:,} bytes)"
                raise UsageError(f"{f}: {what}; {_REDOWNLOAD}")
            header = json.loads(fh.read(n).decode("utf-8"))
    except OSError as e:
        raise UsageError(f"{f}: cannot read ({e.__class__.__name__}); {_REDOWNLOAD}") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise UsageError(f"{f}: header is not JSON, not a safetensors file; {_REDOWNLOAD}") from None
    if not isinstance(header, dict):
        raise UsageError(f"{f}: header is not a JSON object, not a safetensors file; {_REDOWNLOAD}")
    end = 0
    for name, t in header.items():
        if name == "__metadata__":
            continue
        offsets = t.get("data_offsets") if isinstance(t, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(x) is int for x in offsets)
                and 0 <= offsets[0] <= offsets[1]):
            raise UsageError(f"{f}: tensor {name!r} has no valid data_offsets in the header; {_REDOWNLOAD}")
        dtype = t.get("dtype")
        shape, width = t.get("shape"), _DTYPE_BYTES.get(dtype) if isinstance(dtype, str) else None
        if width and isinstance(shape, list) and all(type(x) is int and x >= 0 for x in shape):
            if _product(shape) * width != offsets[1] - offsets[0]:
                raise UsageError(f"{f}: tensor {name!r} of shape {shape} ({t['dtype']}) does not match its "
                                 f"{offsets[1] - offsets[0]:,} bytes; {_REDOWNLOAD}")
        end = max(end, offsets[1])
    expected = 8 + n + end
    if size != expected:
        what = "truncated" if size < expected else "longer than its tensors"
        raise UsageError(f"{f}: {what}: {size:,} bytes, its header describes {expected:,}; {_REDOWNLOAD}")


def _product(xs: list[int]) -> int:
    out = 1
    for x in xs:
        out *= x
    return out


def check_tokenizer_files(path: str) -> None:
    """The directory holds a tokenizer vocabulary (tokenizer.json, vocab.json, tokenizer.model, ...): without one
    transformers quietly builds a tokenizer of a few special tokens. A tokenizer.json must be a JSON object whose
    vocabulary, if it lists one, is not empty."""
    d = model_dir(path)
    names = set(os.listdir(d))
    if not any(n in names for n in VOCAB_FILES) and not any(n.endswith(VOCAB_SUFFIXES) for n in names):
        raise UsageError(f"{d}: no tokenizer files (tokenizer.json, or vocab.json and merges.txt, tokenizer.model, "
                         "vocab.txt); save the tokenizer beside the model (tokenizer.save_pretrained)")
    if "tokenizer.json" not in names and "vocab.json" in names:  # a BPE tokenizer's vocabulary: token -> id
        vocab = _read_json(d / "vocab.json", "a tokenizer vocabulary (a JSON object of token: id)")
        if not isinstance(vocab, dict) or not vocab:
            raise UsageError(f"{d / 'vocab.json'}: the vocabulary is empty or not a JSON object; save the tokenizer "
                             "again with save_pretrained")
    if "tokenizer.json" in names:
        f = d / "tokenizer.json"
        tok = _read_json(f, "a tokenizers file (tokenizer.save_pretrained writes it)", TOKENIZER_MAX_BYTES)
        model = tok.get("model") if isinstance(tok, dict) else None
        if not isinstance(model, dict):
            raise UsageError(f"{f}: no \"model\" object; expected a tokenizers file (tokenizer.save_pretrained "
                             "writes it)")
        vocab = model.get("vocab")
        if "vocab" in model and not vocab:
            raise UsageError(f"{f}: the vocabulary is empty; save the tokenizer again with save_pretrained")
        added = tok.get("added_tokens") if isinstance(tok.get("added_tokens"), list) else []
        special = {t.get("id") for t in added if isinstance(t, dict) and t.get("special")}
        # BPE, WordPiece, WordLevel map token -> id (Unigram lists pairs: not checked here)
        ids = {v for v in vocab.values() if isinstance(v, int)} if isinstance(vocab, dict) else None
        if ids and ids <= special:
            raise UsageError(f"{f}: the vocabulary holds only the {len(ids)} special tokens; save the tokenizer "
                             "again with save_pretrained")


def check_model_dir(path: str) -> dict:
    """Every check above, in the order the trainer meets the files; returns config.json."""
    cfg = read_model_config(path)
    check_tokenizer_files(path)
    check_weights(path)
    return cfg


def _read_json(f: Path, what: str, max_bytes: int = CONFIG_MAX_BYTES) -> Any:
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


@functools.lru_cache(maxsize=1)
def causal_lm_types() -> frozenset[str] | None:
    """The model_types transformers' AutoModelForCausalLM can build, read from its source (importing
    transformers costs seconds and loads torch); None when transformers or that table cannot be found."""
    try:
        spec = importlib.util.find_spec("transformers")
        if spec is None or not spec.submodule_search_locations:
            return None
        src = (Path(spec.submodule_search_locations[0]) / "models" / "auto" / "modeling_auto.py").read_text("utf-8")
        import ast

        start = src.index("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES = ")
        end = src.index("\n)\n", start) + 3
        call = ast.parse(src[start:end]).body[0].value
        names = frozenset(k for k, _ in ast.literal_eval(call.args[0]))
        return names or None
    except (OSError, ValueError, SyntaxError, AttributeError, IndexError, TypeError, UnicodeDecodeError):
        return None


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("transformers")
    except Exception:  # metadata missing: only the message loses the number
        return "(unknown version)"


# ------------------------------------------------------------------------------------------ the prompt dataset

RESERVED = ("prompt", "answer", "id")
DATA_SUFFIXES = (".jsonl", ".parquet")
HF_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")


@dataclass(frozen=True)
class Fields:
    """Which columns become a row: data.prompt_field, data.answer_field (None: no answers), data.extra_fields."""

    prompt: str = "prompt"
    answer: str | None = "answer"
    extra: tuple[str, ...] = ()

    def __post_init__(self):
        for f in self.extra:
            if f in RESERVED:
                raise bad("extra_fields", f, f"names other than {', '.join(RESERVED)} (those are always present)")

    def columns(self) -> list[str]:
        return [self.prompt] + ([self.answer] if self.answer is not None else []) + list(self.extra)

    def role(self, column: str) -> str:
        return ("prompt_field" if column == self.prompt else "answer_field" if column == self.answer
                else "extra_fields")


def dataset_sources(path: str) -> list[tuple[str, str]]:
    """(source, kind) pairs a dataset path stands for, in reading order: kind "jsonl" or "parquet" for files,
    "arrow" for a directory written by datasets' save_to_disk (its train split for a DatasetDict)."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise bad("prompts path", path, "expected an existing .jsonl or .parquet file or a dataset directory")
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
    doc = _read_json(Path(dd), "a save_to_disk DatasetDict ({\"splits\": [...]})")
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
    """The prompt column of a parquet/Arrow table holds text."""
    import pyarrow as pa

    if not (pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type)
            or getattr(pa.types, "is_string_view", lambda t: False)(arrow_type)):
        raise UsageError(f"{src}: column {fields.prompt!r} (data.prompt_field) holds {arrow_type}; expected text")


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
    import pyarrow as pa

    state = Path(path) / "state.json"
    doc = _read_json(state, "a save_to_disk state ({\"_data_files\": [{\"filename\": ...}]})") \
        if state.is_file() else None
    try:
        files = [d["filename"] for d in doc["_data_files"]]
        if not all(isinstance(f, str) for f in files):
            raise TypeError("filename is not a string")
    except (TypeError, KeyError):
        raise UsageError(f"prompts path: {path!r} is not a readable save_to_disk dataset (state.json lists no "
                         "\"_data_files\")") from None
    rows: list = []
    try:
        for name in files:
            with pa.memory_map(os.path.join(path, name)) as source:
                reader = pa.ipc.open_stream(source)
                check_columns(reader.schema.names, os.path.join(path, name), fields)
                check_prompt_type(reader.schema.field(fields.prompt).type, os.path.join(path, name), fields)
                if max_rows is None:
                    rows.extend(reader.read_all().to_pylist())
                    continue
                for batch in reader:
                    rows.extend(batch.to_pylist()[: max_rows - len(rows)])
                    if len(rows) >= max_rows:
                        return rows
    except (OSError, ValueError, pa.ArrowInvalid) as e:
        raise UsageError(f"prompts path: {path!r} is not a readable save_to_disk dataset "
                         f"({type(e).__name__}: {first_line(e)})") from None
    return rows


def make_row(rec: Any, where: str, row_id: int, fields: Fields) -> dict:
    """`{"prompt": str, "answer": ..., "id": row_id, **extra}` from one record; a missing field or a prompt that
    is not text is a UsageError naming `where` (file and line or row)."""
    if not isinstance(rec, dict):
        raise UsageError(f"{where}: got {type(rec).__name__}; expected an object with a {fields.prompt!r} field")
    if fields.prompt not in rec:
        raise UsageError(f"{where}: no field {fields.prompt!r} (prompt_field); fields are {_names(rec)}")
    prompt = rec[fields.prompt]
    if not isinstance(prompt, str):
        raise UsageError(f"{where}: field {fields.prompt!r} is {type(prompt).__name__}; expected a string")
    row = {"prompt": prompt, "answer": None, "id": row_id}
    if fields.answer is not None:
        if fields.answer not in rec:
            raise UsageError(f"{where}: no field {fields.answer!r} (answer_field); fields are {_names(rec)}")
        row["answer"] = rec[fields.answer]
    for f in fields.extra:
        if f not in rec:
            raise UsageError(f"{where}: no field {f!r} (extra_fields); fields are {_names(rec)}")
        row[f] = rec[f]
    return row


def read_rows(path: str, fields: Fields, *, max_bytes: int | None = None, max_rows: int | None = None
              ) -> tuple[list[dict], bool]:
    """Rows of a dataset path (see dataset_sources) and whether that was all of them. With max_bytes / max_rows
    (the planner), each .jsonl file is read up to max_bytes and each table up to its first max_rows rows, every
    one checked as the trainer checks it; without them, everything."""
    rows: list[dict] = []
    complete = True
    for src, kind in dataset_sources(path):
        if kind == "jsonl":
            size = os.path.getsize(src)
            complete &= max_bytes is None or size <= max_bytes
            for n, rec in iter_jsonl(src, max_bytes):
                rows.append(make_row(rec, f"{src} line {n}", len(rows), fields))
            continue
        if kind == "parquet":
            records = read_parquet(src, fields, max_rows)
        else:
            records = read_arrow_dir(src, fields, max_rows)
        complete &= max_rows is None or len(records) < max_rows
        for i, rec in enumerate(records):
            rows.append(make_row(rec, f"{src} row {i}", len(rows), fields))
    if complete and not rows:
        raise UsageError(f"prompts path: {path!r} has no rows; expected at least one prompt")
    return rows, complete


def _names(cols) -> str:
    names = ", ".join(sorted(map(str, cols)))
    return names if len(names) <= 120 else names[:117] + "..."
