"""Rules for the indexing family (being written)."""
