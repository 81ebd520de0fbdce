"""Rules for the random family (being written)."""
