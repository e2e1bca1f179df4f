"""Kept for old imports: the ``osd serve`` command lives in :mod:`osd.server.run`."""

from osd.server.run import limits_from_args, serve

__all__ = ["limits_from_args", "serve"]
