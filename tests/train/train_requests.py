"""Requests of random prompt ids for the drafter-training tests (the tiny model's vocabulary: ids 1-499)."""
import random

from treedec.runtime.requests import RequestSpec


def id_requests(count: int, seed: int = 0) -> list[RequestSpec]:
    """``count`` requests of 4-11 random prompt ids each (the same for the same seed)."""
    rng = random.Random(seed)
    return [RequestSpec(i, prompt_ids=tuple(rng.randrange(1, 500) for _ in range(rng.randrange(4, 12))))
            for i in range(count)]
