"""Crash-safe checkpoints of what the draft has learned.

Layout of a checkpoint directory::

    ckpt_dir/
      LATEST               name of the newest complete checkpoint (replaced atomically)
      step-000012-1a2b3c4d/  one complete checkpoint (step number, unique suffix)
        draft.safetensors  draft weights
        optim.pt           optimizer state (and update counters)
        meta.json          counters and config at save time

A checkpoint is written into a temporary sibling directory, fsynced, renamed into place
(``os.replace`` is atomic on POSIX) and only then named in ``LATEST`` (written to a
temporary file, fsynced and renamed). A process killed at any point leaves the previous
``LATEST`` and the checkpoint it names intact; stale temporaries are removed on the next
save. Only the newest ``keep`` checkpoints are retained.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid

import torch
from safetensors.torch import load_file, save_file

LATEST = "LATEST"


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: str, write) -> None:
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def save_checkpoint(
    ckpt_dir: str, step: int, state_dict: dict, optim_state: dict | None, meta: dict, keep: int = 3
) -> str:
    """Write checkpoint ``step`` atomically and point ``LATEST`` at it. Returns its path."""
    os.makedirs(ckpt_dir, exist_ok=True)
    for name in os.listdir(ckpt_dir):
        if name.startswith(".tmp-"):
            shutil.rmtree(os.path.join(ckpt_dir, name), ignore_errors=True)
    name = f"step-{step:06d}-{uuid.uuid4().hex[:8]}"  # never reuses a live name
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=ckpt_dir)
    tensors, aliases, seen = {}, {}, {}
    for k, v in state_dict.items():  # tied weights (e.g. embeddings) are stored once
        key = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape))
        if key in seen:
            aliases[k] = seen[key]
        else:
            seen[key] = k
            tensors[k] = v.detach().to("cpu").contiguous()
    meta = dict(meta, aliases=aliases)
    save_file(tensors, os.path.join(tmp, "draft.safetensors"))
    with open(os.path.join(tmp, "draft.safetensors"), "rb+") as f:
        os.fsync(f.fileno())
    _write_file(os.path.join(tmp, "optim.pt"), lambda f: torch.save(optim_state or {}, f))
    _write_file(
        os.path.join(tmp, "meta.json"),
        lambda f: f.write(json.dumps(dict(meta, step=step), indent=1).encode()),
    )
    _fsync_dir(tmp)
    final = os.path.join(ckpt_dir, name)
    os.replace(tmp, final)
    _fsync_dir(ckpt_dir)
    latest_tmp = os.path.join(ckpt_dir, f".tmp-{LATEST}")
    _write_file(latest_tmp, lambda f: f.write(name.encode()))
    os.replace(latest_tmp, os.path.join(ckpt_dir, LATEST))
    _fsync_dir(ckpt_dir)
    steps = sorted(n for n in os.listdir(ckpt_dir) if n.startswith("step-"))
    for old in steps[:-keep]:
        if old != name:
            shutil.rmtree(os.path.join(ckpt_dir, old), ignore_errors=True)
    return final


def latest_checkpoint(ckpt_dir: str) -> str | None:
    """Path of the newest complete checkpoint, or None if there is none."""
    try:
        with open(os.path.join(ckpt_dir, LATEST)) as f:
            name = f.read().strip()
    except FileNotFoundError:
        return None
    path = os.path.join(ckpt_dir, name)
    return path if os.path.isfile(os.path.join(path, "meta.json")) else None


def _mtime(path: str) -> float:
    try:
        return os.path.getmtime(path)
    except OSError:  # removed meanwhile by a concurrent save's cleanup
        return 0.0


def complete_checkpoints(ckpt_dir: str) -> list[str]:
    """Paths of the complete checkpoints in ``ckpt_dir``, the one ``LATEST`` names first,
    then the others newest step first (fallbacks should the newest fail to read).

    A ``step-*`` directory is complete once it exists: it only gets that name by an atomic
    rename after all its files were written and fsynced."""
    latest = latest_checkpoint(ckpt_dir)
    out = [latest] if latest is not None else []
    try:
        names = os.listdir(ckpt_dir)
    except FileNotFoundError:
        return out
    others = [
        os.path.join(ckpt_dir, n)
        for n in names
        if n.startswith("step-") and os.path.isfile(os.path.join(ckpt_dir, n, "meta.json"))
    ]
    others.sort(key=lambda p: (os.path.basename(p).split("-")[1], _mtime(p)), reverse=True)
    return out + [p for p in others if p != latest]


def load_checkpoint(path: str):
    """-> (state_dict, optim_state, meta) of a checkpoint written by save_checkpoint."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint directory {path!r} does not exist")
    state = load_file(os.path.join(path, "draft.safetensors"))
    optim_state = torch.load(os.path.join(path, "optim.pt"), weights_only=False)
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    for alias, name in meta.get("aliases", {}).items():
        state[alias] = state[name]
    return state, optim_state, meta
