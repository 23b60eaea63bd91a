"""Retrieval: the two-tower model's loss, its corpus evaluation and its item index."""
