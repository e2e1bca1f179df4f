"""Where the zoo's checkpoints are found.

The weights live in the git repository (``osd/zoo/weights/<name>``), not in the wheel.
Each model is looked up, in order, in:

1. ``$OSD_ZOO_WEIGHTS`` (a directory holding ``<name>/`` subdirectories), when set;
2. the source checkout's ``osd/zoo/weights``: the directory beside this module, which is
   the checkout itself in an editable install (``make`` installs that way);
3. :func:`cache_dir` (``~/.cache/osd/zoo`` unless ``$OSD_ZOO_CACHE`` or
   ``$XDG_CACHE_HOME`` say otherwise): where the build commands write by default.

A non-editable install from a checkout finds the repository's weights with
``OSD_ZOO_WEIGHTS=<checkout>/osd/zoo/weights``.
"""

from __future__ import annotations

import os

ENV = "OSD_ZOO_WEIGHTS"
# The checkout's weights directory (only present in a source checkout or editable install).
SOURCE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "weights")

# Files that make a model's directory complete: the built-in pair's checkpoints carry
# their tokenizer; the chat drafts use the GGUF target's.
_PAIR_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
_DRAFT_FILES = ("config.json", "model.safetensors")
REQUIRED_FILES = {
    "target": _PAIR_FILES,
    "draft": _PAIR_FILES,
    "draft_code": _PAIR_FILES,
    "chat_draft": _DRAFT_FILES,
    "chat_eagle": _DRAFT_FILES,
}

_CLONE = "git clone the osd repository and set OSD_ZOO_WEIGHTS=<clone>/osd/zoo/weights"
_BUILD_PAIR = "python -m osd.zoo.train (about 10 minutes on 2 idle CPU cores; writes into {cache})"
# How to get each model when no searched directory has it.
HOW_TO_GET = {
    "target": _BUILD_PAIR,
    "draft": _BUILD_PAIR,
    "draft_code": _BUILD_PAIR,
    "chat_draft": "osd draft build --out {cache}/chat_draft (a 33-minute build by default; "
    "it fetches the SmolLM2 GGUF target first)",
    "chat_eagle": "python scripts/build_chat_eagle.py --out {cache}/chat_eagle, from a source "
    "checkout",
}


class ZooWeightsNotFound(FileNotFoundError):
    """No searched directory holds a zoo model; the message says where it looked and how
    to get the model."""


def cache_dir() -> str:
    """``$OSD_ZOO_CACHE``, else ``$XDG_CACHE_HOME/osd/zoo``, else ``~/.cache/osd/zoo``:
    the last place searched, and where the build commands write by default."""
    if os.environ.get("OSD_ZOO_CACHE"):
        return os.path.abspath(os.environ["OSD_ZOO_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "osd", "zoo")


def search_dirs() -> list[str]:
    """The directories searched, in order (``$OSD_ZOO_WEIGHTS`` only when set)."""
    dirs = [os.path.abspath(os.environ[ENV])] if os.environ.get(ENV) else []
    for d in (SOURCE_DIR, cache_dir()):
        if d not in dirs:
            dirs.append(d)
    return dirs


def complete(path: str, name: str) -> bool:
    """Whether ``path`` holds every file model ``name`` needs."""
    return all(os.path.isfile(os.path.join(path, f)) for f in REQUIRED_FILES[name])


def find(*names: str) -> tuple[str, ...] | None:
    """The directories of models ``names`` from the first searched directory that holds
    all of them (models built together, such as the pair sharing a tokenizer, come from
    one place), or None."""
    unknown = [n for n in names if n not in REQUIRED_FILES]
    if unknown:
        raise ValueError(f"unknown zoo models {unknown}; known: {sorted(REQUIRED_FILES)}")
    for base in search_dirs():
        paths = tuple(os.path.join(base, n) for n in names)
        if all(complete(p, n) for p, n in zip(paths, names)):
            return paths
    return None


def missing_message(*names: str) -> str:
    """What :class:`ZooWeightsNotFound` says for ``names``: the places searched and how
    to get the models."""
    how = {HOW_TO_GET[n].format(cache=cache_dir()) for n in names}
    places = "\n".join(f"  {d}" for d in search_dirs())
    ways = "\n".join(f"  - {h}" for h in sorted(how)) + f"\n  - {_CLONE}"
    return (
        f"zoo weights {', '.join(names)} not found (the wheel does not ship them); "
        f"searched, in order:\n{places}\nGet them with one of:\n{ways}"
    )


def require(*names: str) -> tuple[str, ...]:
    """:func:`find`, raising :class:`ZooWeightsNotFound` when no directory has them."""
    found = find(*names)
    if found is None:
        raise ZooWeightsNotFound(missing_message(*names))
    return found


__all__ = [
    "ENV",
    "SOURCE_DIR",
    "ZooWeightsNotFound",
    "cache_dir",
    "search_dirs",
    "find",
    "require",
    "missing_message",
]
