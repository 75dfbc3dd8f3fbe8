"""Reading YAML that nobody vetted (configs, overrides, peers' configs), bounded so that no file can make reading it
slow or large, and reading text files with one-line errors that name the file. Pure Python: never imports torch.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from typing import Any

import yaml

from evenrl.errors import UsageError, first_line

# Aliases (*name) are references, and a few hundred bytes of nested ones expand to billions of values.
MAX_YAML_BYTES = 1024**2  # a config file
MAX_YAML_DEPTH = 64  # nesting, aliases expanded
MAX_YAML_NODES = 100_000  # values (scalars, lists, mappings), aliases expanded
MAX_YAML_CHARS = 4 * 1024**2  # characters of all scalars, aliases expanded


def parse_yaml(text: str, source: str, *, words: bool = False) -> Any:
    """yaml.safe_load, bounded: the document may nest at most MAX_YAML_DEPTH levels and hold at most
    MAX_YAML_NODES values and MAX_YAML_CHARS characters of text once its aliases are expanded, and no alias may
    refer to a collection that contains it. The node graph is composed first (aliases stay shared, so composing
    costs what the text costs, and stops at the same limits) and measured with one memoised pass over it; only
    then is it built, so a "billion laughs" file is refused in milliseconds. Each limit is a one-line UsageError
    naming `source`; bad syntax raises yaml.YAMLError for the caller to word.

    words=True: only true/false (any case) are booleans, as in YAML 1.2 and JSON; yes/no/on/off stay the words
    written (YAML 1.1, and so yaml.safe_load, reads them as booleans). evenrl's own configs are read so: an
    enumeration that has such a word as a value (rollout.router_replay: off) gets what the user wrote, and a
    true/false field reads the words as booleans itself (pydantic's bool takes yes/no/on/off)."""
    loader = (_WordsLoader if words else _BoundedLoader)(text)
    loader.source = source
    try:
        try:
            node = loader.get_single_node()
        except yaml.YAMLError as e:
            # libyaml >= 0.2.5 stops at its own nesting limit (1,000 levels) while it composes in C, before
            # _DepthComposer or _measure can count: the document is then deeper than ours too
            if "maximum nesting depth" in str(e):
                raise UsageError(f"{source}: nested deeper than {MAX_YAML_DEPTH} levels; "
                                 f"the limit is {MAX_YAML_DEPTH}") from None
            raise
        if node is None:
            return None
        _measure(node, source)
        try:
            return loader.construct_document(node)
        except (ValueError, TypeError, OverflowError) as e:  # e.g. an integer of more than 4300 digits
            raise UsageError(f"{source}: a value cannot be read ({first_line(e)}); fix it") from None
    finally:
        loader.dispose()


class _DepthComposer(yaml.composer.Composer):
    """PyYAML's composer, stopping at MAX_YAML_DEPTH nested collections (it recurses once per level) and at
    MAX_YAML_NODES values written out (before any alias is expanded)."""

    source = "YAML"
    _depth = 0
    _nodes = 0

    def compose_node(self, parent, index):
        self._depth += 1
        self._nodes += 1
        try:
            if self._depth > MAX_YAML_DEPTH:
                raise UsageError(f"{self.source}: nested deeper than {MAX_YAML_DEPTH} levels; "
                                 f"the limit is {MAX_YAML_DEPTH}")
            if self._nodes > MAX_YAML_NODES:
                raise UsageError(_too_many(self.source))
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _too_many(source: str) -> str:
    return (f"{source}: more than {MAX_YAML_NODES:,} values (an alias *name counts its values at every use); "
            f"the limit is {MAX_YAML_NODES:,}")


if getattr(yaml, "__with_libyaml__", False):
    class _BoundedLoader(_DepthComposer, yaml.cyaml.CParser, yaml.constructor.SafeConstructor, yaml.resolver.Resolver):
        """libyaml's scanner and parser (~5x faster than PyYAML's), PyYAML's composer (so the depth is bounded)
        and safe constructor: what yaml.safe_load builds."""

        def __init__(self, stream: str):
            yaml.cyaml.CParser.__init__(self, stream)
            _DepthComposer.__init__(self)
            yaml.constructor.SafeConstructor.__init__(self)
            yaml.resolver.Resolver.__init__(self)
else:  # pragma: no cover - PyYAML built without libyaml
    class _BoundedLoader(_DepthComposer, yaml.SafeLoader):
        pass


_BOOL = "tag:yaml.org,2002:bool"


class _WordsLoader(_BoundedLoader):
    """_BoundedLoader whose booleans are true/false only (YAML 1.2's core schema): parse_yaml(words=True)."""

    yaml_implicit_resolvers = {first: [(tag, rx) for tag, rx in rules if tag != _BOOL]
                               for first, rules in yaml.resolver.Resolver.yaml_implicit_resolvers.items()}


_WordsLoader.add_implicit_resolver(_BOOL, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))


def _measure(root: yaml.Node, source: str) -> None:
    """Values, depth and characters of the document with aliases expanded, memoised over node ids (each shared
    node is measured once); a node met again below itself is a recursive alias."""
    done: dict[int, tuple[int, int, int]] = {}  # id -> (values, depth, characters)
    open_: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, finished = stack.pop()
        key = id(node)
        kids = _children(node)
        if finished:
            values = 1 + sum(done[id(k)][0] for k in kids)
            depth = 1 + max((done[id(k)][1] for k in kids), default=0)
            chars = (len(node.value) if isinstance(node, yaml.ScalarNode) else 0) + sum(done[id(k)][2] for k in kids)
            done[key] = (values, depth, chars)
            open_.discard(key)
            if depth > MAX_YAML_DEPTH:
                raise UsageError(f"{source}: nested deeper than {MAX_YAML_DEPTH} levels (counting the levels an alias "
                                 f"*name brings); the limit is {MAX_YAML_DEPTH}")
            if values > MAX_YAML_NODES:
                raise UsageError(_too_many(source))
            if chars > MAX_YAML_CHARS:
                raise UsageError(f"{source}: more than {MAX_YAML_CHARS:,} characters of text (an alias *name "
                                 f"counts its text at every use); the limit is {MAX_YAML_CHARS:,}")
            continue
        if key in done:
            continue
        open_.add(key)
        stack.append((node, True))
        for k in kids:
            if id(k) in open_:
                raise UsageError(f"{source}: line {k.start_mark.line + 1}: an alias refers to a collection that "
                                 "contains it; recursive aliases are not allowed")
            if id(k) not in done:
                stack.append((k, False))


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return []


def read_text_file(path: str | os.PathLike, what: str, utf8_what: str, max_bytes: int = MAX_YAML_BYTES) -> str:
    """A UTF-8 text file's contents, at most `max_bytes` of them; a missing file, a directory, anything but a
    regular file (a FIFO, a device: opening or reading one may never end), a larger file or unreadable bytes is a
    one-line UsageError naming the file and `what` was expected there."""
    p = Path(path)
    if not p.exists():
        raise UsageError(f"{p}: no such file; give {what}")
    if p.is_dir():
        raise UsageError(f"{p}: is a directory; give {what}")
    try:
        # O_NONBLOCK: opening a FIFO without a writer returns at once (a plain open waits for one forever); the
        # type is then checked on what was opened, so nothing swapped in after a check is read
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise UsageError(f"{p}: not a regular file (a FIFO, a device or a socket); give {what}")
            raw = f.read(max_bytes + 1)
        if len(raw) > max_bytes:
            raise UsageError(f"{p}: larger than {max_bytes:,} bytes, the limit for {what}")
        return raw.decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"{p}: cannot read ({e.__class__.__name__}); give {utf8_what}") from None


def read_yaml(path: str | os.PathLike) -> dict:
    """Read an evenrl config, a YAML mapping, with the bounded reader (parse_yaml, yes/no/on/off kept as words);
    every failure is a one-line UsageError naming the file."""
    p = Path(path)
    text = read_text_file(p, "a YAML config file", "a UTF-8 YAML file")
    try:
        data = parse_yaml(text, str(p), words=True)
    except yaml.YAMLError as e:
        raise UsageError(f"{p}: invalid YAML{yaml_error_line(e)}; fix the syntax") from None
    if data is None:
        raise UsageError(f"{p}: file is empty; expected a mapping of sections (model, data, rollout, ...)")
    if not isinstance(data, dict):
        raise UsageError(f"{p}: top level is a {type(data).__name__}; expected a mapping of sections")
    return data


def yaml_error_line(e: yaml.YAMLError) -> str:
    """' at line N' for a YAML error that knows where it happened, else ''."""
    mark = getattr(e, "problem_mark", None)
    return f" at line {mark.line + 1}" if mark is not None else ""
