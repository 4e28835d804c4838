"""Helpers for the tests and the benchmarks (test servers, schemas); not shipped in the wheel."""
