"""Floor 0, what every layer uses: regions of tensors, the schema records (``TensorInfo``,
``dtype_name``...), agreement between ranks, key runs for humans, progress bars, the collector
pause, versions and the lazy public modules. Imports nothing of sdadapt but :mod:`sdadapt.errors`."""
