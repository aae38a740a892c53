"""Floor 2, recipes: the node kinds a plan is made of (small expression trees saying how a target
tensor is made from source tensors) and the pure tensor functions they compute with (quantized
formats, interleaving). Rules build recipes; the engine runs them.

A node kind is named for the value it makes (``Stacked``, ``Converted``, ``DequantizedFP8``,
``MergedLora``); the rule that builds it, in :mod:`sdadapt.rules`, for the action (``Stack``,
``Cast``, ``DequantFP8``, ``MergeLora``), so that no node shares a rule's name."""
