"""Drafters: the contract (base), the registry by name, DFlash with DDTree trees, n-gram lookup."""
