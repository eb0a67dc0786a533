"""Decoding loops. ``reference``: the jitted speculative loop over tabular models used to prove rules lossless."""
