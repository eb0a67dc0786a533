"""Prompt sets: the shipped prompt files and their builder from pinned PyPI packages (:mod:`.prompts`), and the
same sets as seqio Tasks (:mod:`.seqio_tasks`, the seqio extra)."""
