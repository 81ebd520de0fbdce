"""Sample programs for the contractions family (being written)."""

PROGRAMS: list = []
