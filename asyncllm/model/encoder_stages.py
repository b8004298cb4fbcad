"""A vision encoder's pass as a generator of stages, so that one large image can be encoded over several
engine steps (model/image_embeddings.py, docs/multimodal.md "Scheduling").

A family's ``encode_image_stages(image)`` is a generator: it runs the tower a layer at a time, yields the
fraction of the pass done after each layer, and returns the image's embedding rows. The engine resumes it
in each step with a share of the step's encoder budget, while the running streams decode, and starts the
image's prefill chunk once it has finished. ``run_stages`` runs one to the end (a whole pass in one step).
"""

from __future__ import annotations

from typing import Generator, TypeVar

Result = TypeVar("Result")
Stages = Generator[float, None, Result]


def run_stages(stages: Stages) -> Result:
    """What the generator ``stages`` returns, every stage run now."""
    while True:
        try:
            next(stages)
        except StopIteration as done:
            return done.value
