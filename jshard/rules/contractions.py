"""Rules for the contractions family (being written)."""
