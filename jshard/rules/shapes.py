"""Rules for the shapes family (being written)."""
