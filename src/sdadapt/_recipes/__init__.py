"""Floor 2, recipes: the node kinds a plan is made of (small expression trees saying how a target
tensor is made from source tensors) and the pure tensor functions they compute with (quantized
formats, interleaving). Rules build recipes; the engine runs them."""
