"""Speculation independent of models: trees, DDTree, acceptance, shapes, per-step metrics."""
