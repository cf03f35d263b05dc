"""Scheduler half of the connector (vLLM's engine-core process): routes each request to
the prefill or decode side, defers, matches and plans transfers; never imports the worker half."""
