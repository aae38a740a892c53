"""Floor 0, what every layer uses: regions of tensors and dtype names, agreement between ranks,
the report records, key runs for humans, progress bars and the collector pause. Imports nothing
of sdadapt but :mod:`sdadapt.errors`."""
