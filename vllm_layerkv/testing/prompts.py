"""Deterministic prompts of varied lengths, built from a small embedded corpus (no data files).

Shared by the e2e tests, the CPU demo and the soak run."""

from __future__ import annotations

import random

CORPUS = """The river runs through the old town and under seven stone bridges.
Merchants once carried salt, wool and copper along its banks to the coast.
In the spring the water rises and the lower streets smell of mud and rain.
A clockmaker on the north bank repairs watches that are older than the town hall.
Children learn to swim in the slow bend below the mill, where the current is weak.
The library keeps a record of every flood since the year the first bridge was built.
Scientists measure the flow each morning and publish the numbers on a small board.
During the festival the bridges are lit with lanterns and boats race at midnight.
Farmers upstream grow barley, apples and a bitter kind of plum used for jam.
A ferry still crosses near the harbour, although a tunnel was finished long ago.
The mayor argues that a new bridge would bring trade, and the council disagrees.
Historians say the town grew because the river was easy to cross at this point.
Each winter the ice breaks in great sheets that pile up against the piers.
Travellers write that the view from the cathedral tower is worth the climb.
The bakery near the square sells bread shaped like fish on the first day of summer.
Engineers plan to widen the channel so that larger ships can reach the port.""".split("\n")


def make_prompt(num_words: int, seed: int) -> str:
    rng = random.Random(seed)
    words: list[str] = []
    while len(words) < num_words:
        words.extend(rng.choice(CORPUS).split())
    return " ".join(words[:num_words])
