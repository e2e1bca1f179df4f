"""Building the chat pair's draft by distillation from its target: ``osd draft build``.

Modules, in the build's order:

- :mod:`osd.draft_build.recipe`: the draft's shape, the training recipe and the teacher
  data's recipes (plain dataclasses);
- :mod:`osd.draft_build.prompts`: the chat prompts, made from the standard library;
- :mod:`osd.draft_build.data`: the teacher data (the target's answers and top-k
  distributions), cached per recipe;
- :mod:`osd.draft_build.train`: the draft's initialisation and training;
- :mod:`osd.draft_build.build`: the stages put together, and the head vocabulary;
- :mod:`osd.draft_build.measure`: ``--measure`` and ``--shapes``;
- :mod:`osd.draft_build.cli`: the command's options and entry point;
- :mod:`osd.draft_build.common`: logging, progress bars, the thread tuner, the cache
  directory and the checkpoint writer.

Nothing is imported here, so ``osd draft build --help`` loads only the recipe.
"""
