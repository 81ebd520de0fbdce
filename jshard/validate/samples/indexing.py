"""Sample programs for the indexing family (being written)."""

PROGRAMS: list = []
