"""Criteo TSV preprocessing: parse, count, number the values, write."""
