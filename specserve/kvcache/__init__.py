"""The paged KV cache: page bookkeeping (block manager, no torch) and the page pool (tensors)."""
