"""Old module paths that still import: each name below is an alias of the module that now
holds its code (the same module object, so attributes and monkeypatching agree). Code in
this repository imports the new paths; these keep users' imports working.

Installed by ``osd/__init__.py`` as a ``sys.meta_path`` finder: ``import osd.drafters``
returns ``osd.spec_decode.model_drafter`` itself, without a shim file per module.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

MOVED = {
    "osd.drafters": "osd.spec_decode.model_drafter",
    "osd.drafter_factory": "osd.spec_decode.factory",
    "osd.eagle_drafter": "osd.spec_decode.eagle_drafter",
    "osd.fused_step": "osd.spec_decode.fused_step",
    "osd.lookup_history": "osd.spec_decode.lookup_history",
    "osd.prompt_lookup": "osd.spec_decode.lookup_drafter",
    "osd.speculative": "osd.spec_decode.step",
    "osd.server_limits": "osd.server.limits",
    "osd.server_metrics": "osd.server.metrics",
    "osd.server_requests": "osd.server.requests",
    "osd.server_run": "osd.server.run",
    "osd.chat": "osd.chat_template",
    "osd.online.graphs": "osd.online.train_graphs",
    "osd.demo_report": "osd.demo.report",
    "osd.demo_serve": "osd.demo.serve",
    "osd.demo_workloads": "osd.demo.workloads",
    "osd.models.gguf_blocks": "osd.models.gguf.blocks",
    "osd.models.gguf_tokenizer": "osd.models.gguf.tokenizer",
}


class _Alias(importlib.abc.Loader):
    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec):
        return importlib.import_module(self.target)

    def exec_module(self, module) -> None:
        pass  # the target module ran when it was imported


class MovedModules(importlib.abc.MetaPathFinder):
    """Finds the old names of :data:`MOVED` and loads them as their new modules."""

    def find_spec(self, fullname, path=None, target=None):
        new = MOVED.get(fullname)
        if new is None:
            return None
        return importlib.util.spec_from_loader(fullname, _Alias(new))


def install() -> None:
    if not any(isinstance(f, MovedModules) for f in sys.meta_path):
        sys.meta_path.append(MovedModules())
