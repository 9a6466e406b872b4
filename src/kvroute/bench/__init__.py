"""Benchmarks (`kvroute bench ...`): measured, never asserted in tests."""
