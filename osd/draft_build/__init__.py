"""Building drafts by distillation from their target: ``osd draft build``.

The chat pair's draft (SmolLM2-135M-Instruct), in the build's order:

- :mod:`osd.draft_build.recipe`: the draft's shape, the training recipe and the teacher
  data's recipes (plain dataclasses);
- :mod:`osd.draft_build.prompts`: the chat prompts, made from the standard library;
- :mod:`osd.draft_build.data`: the teacher data (the target's answers and top-k
  distributions), cached per recipe;
- :mod:`osd.draft_build.train`: the draft's initialisation and training;
- :mod:`osd.draft_build.build`: the stages put together, and the head vocabulary;
- :mod:`osd.draft_build.measure`: ``--measure`` and ``--shapes``.

A draft for any target (``--target PATH``, ``docs/own_draft.md``):

- :mod:`osd.draft_build.shape`: the draft's shape and head vocabulary size from the
  target's config;
- :mod:`osd.draft_build.target_data`: its prompts (chat template or plain text), the
  teacher's answers saved in shards, the head vocabulary from them;
- :mod:`osd.draft_build.target_train`: training over the head vocabulary, checkpointed;
- :mod:`osd.draft_build.tune`: the serving settings measured on this machine;
- :mod:`osd.draft_build.target_build`: the stages put together, the budget across runs
  and the build's saved state.

Both: :mod:`osd.draft_build.cli` (the command's options and entry point) and
:mod:`osd.draft_build.common` (logging, progress bars and status lines, the thread tuner,
the cache directory and the checkpoint writer).

Nothing is imported here, so ``osd draft build --help`` loads only the recipe.
"""
