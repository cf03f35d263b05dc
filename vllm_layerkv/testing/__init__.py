"""Test and demo support for vllm-layerkv: offline model preparation and `vllm serve` launchers."""
