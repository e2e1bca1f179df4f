"""The zoo's corpus: Python's own standard library, split into two domains.

Every machine with Python has the standard library's source, so the built-in model pair
is trained on it and its query streams are drawn from it. Each source file yields one
document per domain:

- ``prose``: the file's docstrings and comment blocks, in source order (English text);
- ``code``: the file's source with its docstrings and comments removed (Python).

Which files take part, and how they are split, depends only on their path relative to
the stdlib root, so the split is stable across machines and Python versions:

- test suites, generated tables (``encodings``, ``pydoc_data``) and build-specific or
  installed files (``_sysconfigdata_*``, ``site-packages``) are excluded;
- a file belongs to the ``heldout`` split when the SHA-1 of its relative path falls in
  the last :data:`HELDOUT_PERCENT` of 100 buckets, else to ``train``. Training sees only
  ``train`` files; query streams come only from ``heldout`` files.

Files that cannot be read, decoded or parsed by the running Python are skipped.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import inspect
import io
import os
import sysconfig
import tokenize
from dataclasses import dataclass

DOMAINS = ("prose", "code")
SPLITS = ("train", "heldout")
# Percentage of files (by path hash) held out from all training for the query streams.
HELDOUT_PERCENT = 12

# Directory names whose whole subtree is excluded (tests, generated data, installs).
_EXCLUDED_DIRS = frozenset(
    {
        "test",
        "tests",
        "idle_test",
        "site-packages",
        "dist-packages",
        "__pycache__",
        "encodings",
        "pydoc_data",
        "lib-dynload",
        "__phello__",
    }
)
# File name prefixes excluded anywhere: test modules and build-specific data.
_EXCLUDED_PREFIXES = ("test_", "_sysconfigdata", "__hello__")


@dataclass(frozen=True)
class Document:
    """One domain's text extracted from one stdlib source file.

    Attributes:
        path: the file's path relative to the stdlib root, with ``/`` separators.
        domain: ``"prose"`` or ``"code"``.
        text: the extracted text (never empty).
    """

    path: str
    domain: str
    text: str


def stdlib_root() -> str:
    """The running interpreter's standard library directory."""
    return sysconfig.get_paths()["stdlib"]


def split_of(path: str) -> str:
    """``"heldout"`` or ``"train"`` for a stdlib-relative path, by the SHA-1 of the path."""
    bucket = int(hashlib.sha1(path.encode("utf-8")).hexdigest()[:8], 16) % 100
    return "heldout" if bucket >= 100 - HELDOUT_PERCENT else "train"


def source_files(root: str | None = None) -> list[str]:
    """Sorted stdlib-relative paths (``/`` separated) of the corpus's ``.py`` files."""
    root = stdlib_root() if root is None else root
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [
            d for d in dirnames if d not in _EXCLUDED_DIRS and not d.startswith("config-")
        ]
        for name in filenames:
            if name.endswith(".py") and not name.startswith(_EXCLUDED_PREFIXES):
                rel = os.path.relpath(os.path.join(dirpath, name), root)
                found.append(rel.replace(os.sep, "/"))
    return sorted(found)


def _read_source(full_path: str) -> str | None:
    """The file decoded per PEP 263, or None when it cannot be read or decoded."""
    try:
        with open(full_path, "rb") as f:
            raw = f.read()
        encoding, _ = tokenize.detect_encoding(io.BytesIO(raw).readline)
        return raw.decode(encoding)
    except (OSError, SyntaxError, UnicodeDecodeError, LookupError):
        return None


def _docstring_nodes(tree: ast.AST) -> list[ast.Constant]:
    """Docstring constants of the module, classes and functions, in source order."""
    nodes = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if (
                body
                and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)
            ):
                nodes.append(body[0].value)
    return sorted(nodes, key=lambda n: (n.lineno, n.col_offset))


def _comment_text(comment: str) -> str:
    """A comment's text without the ``#`` marks; empty for rulers such as ``#-----``."""
    text = comment.strip("#").strip()
    return text if any(ch.isalnum() for ch in text) else ""


def split_source(source: str) -> tuple[str, str] | None:
    """Split Python source into its prose and its code.

    Args:
        source: the text of one Python file.

    Returns:
        ``(prose, code)``: prose is the docstrings (cleaned with ``inspect.cleandoc``)
        and comment blocks in source order, separated by blank lines; code is the source
        with docstring lines and comments removed and blank-line runs collapsed. None when
        the running Python cannot parse or tokenize the source.
    """
    source = source.replace("\r\n", "\n").replace("\r", "\n")
    try:
        tree = ast.parse(source)
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (SyntaxError, ValueError, tokenize.TokenError, RecursionError, MemoryError):
        return None
    lines = source.split("\n")  # the rows of tokenize and ast (not str.splitlines)
    drop = set()  # 0-based line numbers removed from the code
    cut = {}  # 0-based line number -> column where a trailing comment starts
    pieces = []  # (line, column, prose text)
    for node in _docstring_nodes(tree):
        first, last = node.lineno - 1, node.end_lineno - 1
        whole_lines = (
            not lines[first][: node.col_offset].strip()
            and not lines[last][node.end_col_offset :].strip()
        )
        if whole_lines:
            drop.update(range(first, last + 1))
        text = inspect.cleandoc(node.value).strip()
        if text:
            pieces.append((first, node.col_offset, text))
    last_own_row = None  # row of the previous own-line comment, to join blocks
    for tok in tokens:
        if tok.type != tokenize.COMMENT:
            continue
        row, col = tok.start[0] - 1, tok.start[1]
        own_line = not lines[row][:col].strip()
        if own_line:
            drop.add(row)
        else:
            cut[row] = col
        text = _comment_text(tok.string)
        if not text or (row == 0 and tok.string.startswith("#!")):
            continue
        if own_line and last_own_row == row - 1 and pieces:
            start_row, start_col, previous = pieces[-1]
            pieces[-1] = (start_row, start_col, previous + " " + text)
        else:
            pieces.append((row, col, text))
        last_own_row = row if own_line else None
    pieces.sort(key=lambda p: (p[0], p[1]))
    prose = "\n\n".join(text for _, _, text in pieces if text)
    kept, blank = [], True
    for i, line in enumerate(lines):
        if i in drop:
            continue
        line = (line[: cut[i]] if i in cut else line).rstrip()
        if not line:
            if blank:
                continue
            blank = True
        else:
            blank = False
        kept.append(line)
    code = "\n".join(kept).strip("\n")
    return prose, code


@functools.lru_cache(maxsize=8)
def _split_documents(root: str, split: str) -> tuple[Document, ...]:
    docs = []
    for rel in source_files(root):
        if split_of(rel) != split:
            continue
        source = _read_source(os.path.join(root, rel))
        parts = split_source(source) if source is not None else None
        if parts is None:
            continue
        for domain, text in zip(DOMAINS, parts):
            if text.strip():
                docs.append(Document(rel, domain, text))
    return tuple(docs)


def documents(domain: str, split: str, root: str | None = None) -> list[Document]:
    """The corpus documents of one domain and split, in sorted path order.

    Args:
        domain: ``"prose"`` or ``"code"``.
        split: ``"train"`` or ``"heldout"``.
        root: stdlib directory (default: the running interpreter's).

    Raises:
        ValueError: on an unknown domain or split.
    """
    if domain not in DOMAINS:
        raise ValueError(f"domain must be one of {DOMAINS}, got {domain!r}")
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    root = os.path.abspath(stdlib_root() if root is None else root)
    return [d for d in _split_documents(root, split) if d.domain == domain]
