"""Interaction logs (who engaged with what, when): reading them, splitting them for retrieval,
the planted log, and the ranking datasets made from them."""
