"""Sample programs for the shapes family (being written)."""

PROGRAMS: list = []
