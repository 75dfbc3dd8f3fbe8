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
import warnings
from typing import Any, Union

from evenrl.errors import UsageError, first_line

# Pillow's own decompression-bomb bound (Image.MAX_IMAGE_PIXELS, ~89.5 M pixels: 9459 x 9459); past it decoding
# alone takes gigabytes, while a vision-language processor would shrink the image to data.max_pixels anyway.
MAX_IMAGE_PIXELS = 89_478_485
IMAGE_PLACEHOLDER = "<image>"  # EasyR1's marker in a prompt's text: where the row's next image goes

Source = Union[bytes, str]  # an encoded image, or the absolute path of an image file
_WANTED = "a list of image bytes, {bytes, path} dicts (Hugging Face datasets' Image) or file paths"


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
            raise UsageError(f"{where}: an image ({key}) is a dict without bytes or path; expected {_WANTED}")
    if isinstance(item, (bytes, bytearray, memoryview)):
        return bytes(item)
    if isinstance(item, str) and item:
        if item.startswith(("http://", "https://")):
            raise UsageError(f"{where}: image {item!r} ({key}) is a URL; evenrl never downloads: store the file "
                             "beside the data and give its path")
        return item if os.path.isabs(item) else os.path.normpath(os.path.join(base_dir, item))
    raise UsageError(f"{where}: an image ({key}) is {_kind(item)}; expected {_WANTED}")


def _kind(v: Any) -> str:
    return "empty text" if v == "" else "null" if v is None else type(v).__name__


def check_image(src: Source, where: str) -> tuple[int, int]:
    """Decode the image once, whole; returns (width, height). A missing, unreadable, truncated or too large image
    is a UsageError naming `where` and the file."""
    from PIL import Image, UnidentifiedImageError

    what = f"{where}: image {src}" if isinstance(src, str) else f"{where}: an image ({len(src):,} bytes)"
    if isinstance(src, str) and not os.path.isfile(src):
        raise UsageError(f"{what} does not exist; image paths are read relative to the data file")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(src if isinstance(src, str) else io.BytesIO(src)) as im:
                w, h = im.size  # read from the header: the size is checked before any pixel is decoded
                if w * h > MAX_IMAGE_PIXELS:
                    raise _TooLarge(w, h)
                im.load()
    except _TooLarge as e:
        raise UsageError(f"{what} is {e.w:,} x {e.h:,} pixels, more than {MAX_IMAGE_PIXELS:,}; shrink it "
                         "(the processor resizes to data.max_pixels anyway)") from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise UsageError(f"{what} is larger than {MAX_IMAGE_PIXELS:,} pixels ({first_line(e)}); shrink it "
                         "(the processor resizes to data.max_pixels anyway)") from None
    except UnidentifiedImageError:
        raise UsageError(f"{what} is not an image Pillow can read; expected PNG, JPEG or another image file") from None
    except (OSError, SyntaxError, ValueError) as e:  # Pillow's words for a truncated or corrupt file
        raise UsageError(f"{what} is truncated or corrupt ({first_line(e)}); re-export the image") from None
    return w, h


class _TooLarge(Exception):
    def __init__(self, w: int, h: int):
        self.w, self.h = w, h


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

