"""A throwaway adapter package for tests/test_registry.py (stands in for sdadapt.adapters)."""
