"""Sample programs for the random family (being written)."""

PROGRAMS: list = []
