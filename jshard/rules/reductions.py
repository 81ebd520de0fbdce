"""Rules for the reductions family (being written)."""
