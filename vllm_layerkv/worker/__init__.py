"""Worker half of the connector (one per GPU/CPU worker process): the per-layer hook, the
sender thread (prefill) and the transfer table (decode)."""
