"""Reading a YAML config safely: UTF-8 only, duplicate keys refused, aliases allowed only while what
they expand to stays small and acyclic, control characters refused in values that may reach a
shell or a generated script; every problem with its file and line.

PyYAML's `safe_load` builds no arbitrary objects, but it keeps the last of two equal keys
silently (a second `training:` block drops the first) and expands aliases by reference: 538 bytes
of nested aliases ("billion laughs") become gigabytes once anything copies the structure, and an
anchor inside itself makes a cycle. Both are caught on the composed node graph, before any Python
object is built. PyYAML's composer (and every walk of the result) recurses once per level, so a
document nested a few thousand deep ends in a RecursionError: its depth, aliases expanded, is
measured on the event stream (the parser is a state machine and does not recurse) before composing.
"""

from __future__ import annotations

from typing import Any

import yaml

#: Values an expanded document may hold; a config has a few hundred.
MAX_NODES = 100_000
#: Levels of nesting a document may have, aliases expanded; a config has about five.
MAX_DEPTH = 64
#: Keys whose values are multi-line text by nature (Jinja chat templates).
MULTILINE_KEYS = ("chat_template",)


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader (no Python object tags)."""


def _line(node: yaml.Node) -> int:
    return node.start_mark.line + 1


def _check_graph(root: yaml.Node, source: str) -> list[str]:
    """Duplicate keys, cycles and the expanded size of the composed document."""
    problems: list[str] = []
    sizes: dict[int, int] = {}
    visiting: set[int] = set()

    def size(node: yaml.Node) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in visiting:
            raise RecursionError(f"{source}:{_line(node)}: an anchor is used inside itself (a cycle)")
        visiting.add(key)
        total = 1
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for k, v in node.value:
                if isinstance(k, yaml.ScalarNode) and k.tag != "tag:yaml.org,2002:merge":
                    if k.value in seen:
                        problems.append(
                            f"{source}:{_line(k)}: duplicate key {k.value!r} (first at line {seen[k.value]}); "
                            "YAML would keep only the last one"
                        )
                    seen.setdefault(k.value, _line(k))
                total += size(k) + size(v)
                if total > MAX_NODES:
                    break
        elif isinstance(node, yaml.SequenceNode):
            for v in node.value:
                total += size(v)
                if total > MAX_NODES:
                    break
        visiting.discard(key)
        sizes[key] = total
        return total

    try:
        if size(root) > MAX_NODES:
            problems.append(
                f"{source}: the document's aliases expand to more than {MAX_NODES:,} values (an alias bomb?)"
            )
    except RecursionError as exc:
        message = str(exc)
        problems.append(message if message.startswith(source) else f"{source}: aliases nest too deeply")
    return problems


def depth_problem(text: str, source: str, max_depth: int = MAX_DEPTH) -> str | None:
    """A located problem when the YAML `text` nests deeper than `max_depth` (an alias counts
    as deep as the collection it names); None otherwise, and None for text the parser refuses (the
    composer then says why, with its line)."""
    depth = 0
    # Per open collection: (anchor, its depth, the deepest level reached inside it).
    open_: list[tuple[str | None, int, int]] = []
    anchors: dict[str, int] = {}  # anchor -> levels it spans
    try:
        for event in yaml.parse(text, Loader=_Loader):
            here = depth
            if isinstance(event, yaml.AliasEvent):
                here = depth + anchors.get(event.anchor, 0)
            elif isinstance(event, yaml.CollectionStartEvent):
                depth += 1
                here = depth
                open_.append((event.anchor, depth, depth))
            elif isinstance(event, yaml.CollectionEndEvent) and open_:
                anchor, start, deepest = open_.pop()
                if anchor:
                    anchors[anchor] = deepest - start + 1
                if open_ and deepest > open_[-1][2]:  # the enclosing collection reaches as deep
                    open_[-1] = (open_[-1][0], open_[-1][1], deepest)
                depth -= 1
            if open_ and here > open_[-1][2]:
                open_[-1] = (open_[-1][0], open_[-1][1], here)
            if here > max_depth:
                line = event.start_mark.line + 1 if event.start_mark else 0
                return (
                    f"{source}:{line}: nested more than {max_depth} levels deep (aliases expanded); "
                    "a config nests a few levels"
                )
    except yaml.YAMLError:
        return None
    return None


def key_lines(root: yaml.Node | None) -> dict[tuple, int]:
    """Each key path of a composed document -> its 1-based line (list items by index)."""
    lines: dict[tuple, int] = {}
    seen: set[int] = set()

    def walk(node: Any, path: tuple, depth: int) -> None:
        # An alias is the anchored node object again: walk each node once (an alias bomb expands
        # to millions of paths), and bound the depth of the walk itself.
        if depth > 64 or id(node) in seen:
            return
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                p = path + (k.value,)
                lines.setdefault(p, _line(k))
                walk(v, p, depth + 1)
        elif isinstance(node, yaml.SequenceNode):
            for i, v in enumerate(node.value):
                lines.setdefault(path + (i,), _line(v))
                walk(v, path + (i,), depth + 1)

    if root is not None:
        walk(root, (), 0)
    return lines


def parse(raw: bytes, source: str) -> tuple[Any, dict[tuple, int], list[str]]:
    """Parse a config file's bytes.

    Returns:
        (data or None, key path -> line, problems). `data` is None when there are problems.
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        return None, {}, [f"{source}:{line}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start})"]
    too_deep = depth_problem(text, source)
    if too_deep:
        return None, {}, [too_deep]
    loader = None
    try:
        loader = _Loader(text)  # its reader refuses some characters (C1 controls) right here
        root = loader.get_single_node()
        if root is None:
            return {}, {}, []
        problems = _check_graph(root, source)
        lines = key_lines(root)
        if problems:
            return None, lines, problems
        return loader.construct_document(root), lines, []
    except yaml.reader.ReaderError as exc:
        line = text[: exc.position].count("\n") + 1
        return None, {}, [f"{source}:{line}: not valid YAML: the character {chr(exc.character)!r} is not allowed"]
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{source}:{mark.line + 1}" if mark else source
        return None, {}, [f"{where}: not valid YAML: {getattr(exc, 'problem', None) or exc}"]
    finally:
        if loader is not None:
            loader.dispose()


def control_characters(data: Any, path: tuple = ()) -> list[tuple[tuple, str]]:
    """(key path, what) for every string value holding a control character, outside the keys whose
    values are multi-line text. A newline or an escape in a path, a name or an environment value
    would reach a log line, a job name or a generated script. Locations, not :class:`Problem`s: the
    loader turns each key path into `file:line` (or the override that set it)."""
    out: list[tuple[tuple, str]] = []
    if isinstance(data, dict):
        for k, v in data.items():
            if k in MULTILINE_KEYS:
                continue
            out += control_characters(v, path + (k,))
    elif isinstance(data, list):
        for i, v in enumerate(data):
            out += control_characters(v, path + (i,))
    elif isinstance(data, str):
        bad = sorted({c for c in data if ord(c) < 0x20 or ord(c) == 0x7F})
        if bad:
            names = ", ".join(repr(c) for c in bad)
            out.append(
                (path, f"contains control character(s) {names}: refused in values that can reach a shell or a log")
            )
    return out
