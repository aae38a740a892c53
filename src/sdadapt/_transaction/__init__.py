"""Floor 6, transactions: load, training state (save/load with the optimizer), export and convert,
verify, shrink and diff; each plans on every rank, agrees, then commits or changes nothing."""
