"""Sample programs for the reductions family (being written)."""

PROGRAMS: list = []
