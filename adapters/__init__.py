"""Adapters shipped with sdadapt, one module per model family (``sdadapt.get_adapter(name)``)."""
