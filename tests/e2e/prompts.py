"""The e2e tests' prompt set (the generator lives in ``vllm_layerkv.testing.prompts``)."""

from __future__ import annotations

from vllm_layerkv.testing.prompts import make_prompt

__all__ = ["PROMPT_WORDS", "PROMPTS", "make_prompt"]

PROMPT_WORDS = [3, 5, 9, 16, 24, 40, 64, 90, 130, 170, 210, 260, 320, 380, 450, 520, 600,
                680, 760, 850, 940, 1020, 30, 12]
PROMPTS = [make_prompt(n, seed=i) for i, n in enumerate(PROMPT_WORDS)]
