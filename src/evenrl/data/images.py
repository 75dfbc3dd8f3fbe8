"""A prompt's images as a dataset stores them, read and checked without torch: the image column's values
(EasyR1's layout: image bytes, {"bytes", "path"} dicts as Hugging Face `datasets` stores an Image feature, or file
paths relative to the data file), image parts of chat messages, and each image decoded once to prove it is whole.

    sources = image_sources(row["images"], "train.parquet row 3", base_dir="/data")   # bytes or absolute paths
    check_image(sources[0], "train.parquet row 3")                                   # (width, height)

Every problem is a one-line UsageError naming the row and, for a file, the file: a missing path, a file that is not
an image, a truncated one, one larger than MAX_IMAGE_PIXELS (decoding it would take gigabytes before the processor
could shrink it), a column of the wrong type. The trainer checks every row before it writes anything, `evenrl plan`
the rows it reads. Pure Python and Pillow: never imports torch.
"""

from __future__ import annotations

import io
import os
import re
import warnings
from typing import Any, Union

from evenrl.errors import UsageError, first_line

# Pillow's own decompression-bomb bound (Image.MAX_IMAGE_PIXELS, ~89.5 M pixels: 9459 x 9459); past it decoding
# alone takes gigabytes, while a vision-language processor would shrink the image to data.max_pixels anyway.
MAX_IMAGE_PIXELS = 89_478_485
IMAGE_PLACEHOLDER = "<image>"  # EasyR1's marker in a prompt's text: where the row's next image goes

Source = Union[bytes, str]  # an encoded image, or the absolute path of an image file
_WANTED = "image bytes, {bytes, path} dicts or file paths"
_COLUMN_FIX = "point data.image_key at the image column"


def image_sources(value: Any, where: str, base_dir: str, key: str = "data.image_key") -> list[Source]:
    """The images of one row's image column (one image or a list of them) as encoded bytes or absolute paths."""
    items = value if isinstance(value, (list, tuple)) else [value]
    return [_source(item, where, base_dir, key) for item in items]


def _source(item: Any, where: str, base_dir: str, key: str) -> Source:
    if isinstance(item, dict):  # datasets' Image feature: bytes when embedded, else the path it was loaded from
        if item.get("bytes"):
            item = item["bytes"]
        elif isinstance(item.get("path"), str) and item["path"]:
            item = item["path"]
        else:
            raise ImageError(f"{os.path.basename(where)}: an image ({key}) is a dict without bytes or path; "
                             f"expected {_WANTED}", _COLUMN_FIX)
    if isinstance(item, (bytes, bytearray, memoryview)):
        return bytes(item)
    if isinstance(item, str) and item:
        if item.startswith(("http://", "https://")):
            raise ImageError(f"{os.path.basename(where)}: image {_short(item)!r} ({key}) is a URL; evenrl never "
                             "downloads", "store the file beside the data and give its path")
        return item if os.path.isabs(item) else os.path.normpath(os.path.join(base_dir, item))
    raise ImageError(f"{os.path.basename(where)}: an image ({key}) is {_kind(item)}; expected {_WANTED}", _COLUMN_FIX)


def _kind(v: Any) -> str:
    return "empty text" if v == "" else "null" if v is None else type(v).__name__


def check_image(src: Source, where: str, key: str = "data.image_key") -> tuple[int, int]:
    """Decode the image once, whole; returns (width, height). A missing, unreadable, truncated or too large image
    is an ImageError naming the row, the file (by name: they are read relative to the data file) and `key`, in one
    line that stays under 200 characters with the plan's fix around it."""
    from PIL import Image, UnidentifiedImageError

    row = os.path.basename(where)
    what = (f"{row}: image {_short(os.path.basename(src))} ({key})" if isinstance(src, str) else
            f"{row}: an image of {len(src):,} bytes ({key})")
    if isinstance(src, str) and not os.path.isfile(src):
        raise ImageError(f"{what} does not exist (paths are relative to the data file)")
    too_large = f"over evenrl's limit of {MAX_IMAGE_PIXELS:,}; shrink it"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(src if isinstance(src, str) else io.BytesIO(src)) as im:
                w, h = im.size  # read from the header: the size is checked before any pixel is decoded
                if w * h > MAX_IMAGE_PIXELS:
                    raise _TooLarge(f"{w:,} x {h:,} pixels")
                im.load()
    except _TooLarge as e:
        raise ImageError(f"{what} is {e}, {too_large}") from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        # Pillow refuses it in open(), before the size can be read: its own count, not its limit (twice evenrl's)
        said = re.search(r"\((\d+) pixels\)", str(e))
        raise ImageError(f"{what} is {int(said[1]):,} pixels, {too_large}" if said else f"{what} is {too_large}"
                         ) from None
    except UnidentifiedImageError:
        raise ImageError(f"{what} is not an image Pillow can read (PNG, JPEG, ...)") from None
    except (OSError, SyntaxError, ValueError) as e:  # Pillow's words for a truncated or corrupt file
        raise ImageError(f"{what} is truncated or corrupt ({_short(first_line(e))})") from None
    return w, h


class ImageError(UsageError):
    """An image the run cannot read, or an image column it cannot take; `fix` (the plan's) is about the image, not
    the dataset's text fields."""

    def __init__(self, message: str, fix: str = "shrink, re-export or replace that image"):
        super().__init__(message)
        self.fix = fix


def _short(text: str, most: int = 40) -> str:
    return text if len(text) <= most else "..." + text[-(most - 3):]


class _TooLarge(Exception):
    pass


def image_size(src: Source) -> tuple[int, int]:
    """(width, height) from the image's header (checked by check_image when the dataset was read)."""
    from PIL import Image

    with Image.open(src if isinstance(src, str) else io.BytesIO(src)) as im:
        return im.size


def open_image(src: Source):
    """The image as an RGB PIL image (checked by check_image when the dataset was read)."""
    from PIL import Image

    with Image.open(src if isinstance(src, str) else io.BytesIO(src)) as im:
        return im.convert("RGB")


def message_images(messages: list, where: str, base_dir: str) -> tuple[list, list[Source | None]]:
    """Chat messages with image parts -> (the messages with every image part a bare {"type": "image"}, per image
    part in order the image it carried or None). A part carries its image under "image" or "path" (a path or
    bytes) or is bare; bare parts take the row's image column in order (evenrl.data.readers.make_row)."""
    out, found = [], []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
            raise UsageError(f"{where}: a message is {_kind(m)}; expected {{\"role\": ..., \"content\": ...}}")
        content = m["content"]
        if isinstance(content, str):
            out.append({"role": m["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise UsageError(f"{where}: a message's content is {_kind(content)}; expected text or a list of parts")
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                parts.append({"type": "text", "text": part["text"]})
            elif kind == "image":
                carried = part.get("image", part.get("path"))
                found.append(None if carried is None else _source(carried, where, base_dir, "an image part"))
                parts.append({"type": "image"})
            else:
                raise UsageError(f"{where}: a message part is {part!r:.60}; expected {{\"type\": \"text\", \"text\": "
                                 "...}} or {{\"type\": \"image\"[, \"image\": path]}}")
        out.append({"role": m["role"], "content": parts})
    return out, found

