"""KV memory and geometry: KV cache groups, the per-layer layout, block reads and writes,
staging buffers for mismatched TP, and the TP head-slice math."""
