"""What test modules share (never a test module itself): checkpoint writers (``checkpoints``),
models (``models``, ``reference_models``, ``reference_deepseek``, ``titan_models``, ``draft_natives``),
release writers (``fp8_releases``, ``scaled_releases``, ``ct_release``, ``lora_cases``), the
corpora of bad input, the gloo launcher (``dist_helper``, with ``aborts``: the teardown aborts it
saw) and the scripts run alone in small venvs (``compat_cases``, ``titan_compat``). Test modules import ``support.X``; tests/ is on the path
(tests/conftest.py, and ``dist_helper`` for its ranks)."""
