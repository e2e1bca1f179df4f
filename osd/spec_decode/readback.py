"""The speculative step's one host read-back: everything the host needs of a step in one
small tensor, so a step syncs once."""

from __future__ import annotations

import dataclasses

import torch

from osd.sampling import nonfinite_rows


def pack_readback(
    n: torch.Tensor, logits: torch.Tensor, columns: dict, out: torch.Tensor, bad=None
):
    """The step's one read-back as a single ``[B, 2 + len(columns) + D + 1]`` float64
    tensor: per row the accepted count, the non-finite flag (``bad [B]``, else
    :func:`~osd.sampling.nonfinite_rows` of ``logits``), each named ``[B]`` column, then
    the sampled tokens (float64 holds every token id exactly). Returns ``(packed, column
    names)``."""
    if bad is None:
        bad = nonfinite_rows(logits)
    cols = [n[:, None], bad[:, None]] + [c[:, None] for c in columns.values()]
    return torch.cat([c.double() for c in cols] + [out.double()], 1), tuple(columns)


@dataclasses.dataclass
class Readback:
    """The host values of :func:`pack_readback`."""

    accepted: list[int]
    nonfinite: list[float]
    columns: dict[str, list[float]]
    tokens: list[list[int]]  # per row: the sampled tokens, accepted[b] + 1 of them used

    @classmethod
    def direct(
        cls, n: torch.Tensor, bad: torch.Tensor, columns: dict, out: torch.Tensor
    ) -> "Readback":
        """The same values read tensor by tensor: on the CPU a read is no sync, and the
        packing's conversions and copy cost more than the reads."""
        return cls(
            n.tolist(),
            bad.tolist(),
            {name: c.tolist() for name, c in columns.items()},
            out.tolist(),
        )

    @classmethod
    def fetch(cls, packed: torch.Tensor, names: tuple) -> "Readback":
        rows = packed.tolist()  # the host sync
        c = 2 + len(names)
        return cls(
            [int(r[0]) for r in rows],
            [r[1] for r in rows],
            {name: [r[2 + i] for r in rows] for i, name in enumerate(names)},
            [[int(t) for t in r[c:]] for r in rows],
        )
