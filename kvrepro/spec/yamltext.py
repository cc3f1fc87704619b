"""YAML as kvrepro reads its own files (matrix.yaml, defects/*.yaml): a strict safe loader and
line numbers for every key, so that a problem is reported as file:line.

Shared by spec/ (matrices), suite/ (catalogue entries) and matrix/ (checks against a loaded
matrix's text), which all point their users at a line of the file they wrote.
"""

from __future__ import annotations

from typing import Any

import yaml

MAX_YAML_NODES = 100_000  # YAML nodes after alias expansion (a normal matrix has a few hundred)


def line_index(text: str) -> dict[tuple[Any, ...], int]:
    """Map each YAML path (tuple of keys/indices) to its 1-based line number."""
    lines: dict[tuple[Any, ...], int] = {}

    def walk(node: yaml.Node, path: tuple[Any, ...]) -> None:
        lines[path] = node.start_mark.line + 1
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                k = key.value
                lines[path + (k,)] = key.start_mark.line + 1
                walk(value, path + (k,))
                lines[path + (k,)] = key.start_mark.line + 1
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                walk(item, path + (i,))

    root = yaml.compose(text, Loader=StrictLoader)  # noqa: S506 (a SafeLoader subclass, bounded)
    if root is not None:
        walk(root, ())
    return lines


def line_for(lines: dict[tuple[Any, ...], int], loc: tuple[Any, ...]) -> int | None:
    path = tuple(int(p) if isinstance(p, str) and p.isdigit() else p for p in loc)
    while path:
        if path in lines:
            return lines[path]
        path = path[:-1]
    return lines.get(())


class DuplicateKey(yaml.YAMLError):
    def __init__(self, key: Any, line: int, first_line: int):
        super().__init__(f"duplicate key {key!r} (first at line {first_line})")
        self.key, self.line, self.first_line = key, line, first_line


class TooBig(yaml.YAMLError):
    def __init__(self, line: int, message: str):
        super().__init__(message)
        self.line = line


class StrictLoader(yaml.SafeLoader):
    """safe_load that refuses a key given twice in one mapping: PyYAML would keep the last one
    silently, and a build or patch written twice is a mistake, never an intent.

    It also counts what aliases expand to (``*a`` stands for every node under ``&a``) and stops
    at ``MAX_YAML_NODES``: a "billion laughs" file (9 aliases of 9 aliases of ...) is a few
    hundred bytes that expand to 9^9 nodes, which every later walk of the data (line numbers,
    validation) would visit. An alias inside its own anchor (a cycle) is refused too."""

    def compose_node(self, parent, index):
        sizes = self.__dict__.setdefault("_kvrepro_sizes", {})
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            target = self.anchors.get(event.anchor)
            if target is not None and id(target) not in sizes:
                raise TooBig(event.start_mark.line + 1, f"alias *{event.anchor} inside its own anchor "
                              "(a cycle); a matrix is a tree: write the values out")
            return super().compose_node(parent, index)
        node = super().compose_node(parent, index)
        if isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        elif isinstance(node, yaml.SequenceNode):
            children = node.value
        else:
            children = []
        size = 1 + sum(sizes.get(id(child), 1) for child in children)
        if size > MAX_YAML_NODES:
            raise TooBig(node.start_mark.line + 1, f"aliases here expand to more than {MAX_YAML_NODES:,} "
                          "values; a matrix needs a few hundred: write the values out instead of nesting aliases")
        sizes[id(node)] = size
        return node

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, int] = {}
        if isinstance(node, yaml.MappingNode):
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.setdefault(key, key_node.start_mark.line + 1)
                except TypeError:  # an unhashable key: the mapping constructor reports it
                    continue
                if first != key_node.start_mark.line + 1:
                    raise DuplicateKey(key, key_node.start_mark.line + 1, first)
        return super().construct_mapping(node, deep=deep)
