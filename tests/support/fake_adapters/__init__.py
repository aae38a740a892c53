"""A throwaway adapter package for tests/plan/test_registry.py (stands in for sdadapt.adapters)."""
