"""The tensor-parallel tests' processes: ``world`` gloo ranks spawned on a free loopback port, each writing its
results to ``out/rank{r}.pt``."""
from __future__ import annotations

import socket
from pathlib import Path
from typing import Callable

import torch


def spawn_ranks(worker: Callable[[int, int, str], None], out: Path, world: int) -> list[dict]:
    """Run ``worker(rank, port, str(out))`` in ``world`` processes; each rank's saved results, rank order."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(port, str(out)), nprocs=world, join=True)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]
