"""Tree-of-Thought search (Yao et al., 2023) on the engine's decoding tree.

- :mod:`~treedec.programs.tot.program`: :func:`tot_bfs`, :func:`tot_dfs`, :func:`tot_batch` and
  :class:`ToTProgram` (a search as a scheduler program);
- :mod:`~treedec.programs.tot.task`: what a search is given and returns (:class:`ToTTask`, the configs,
  :class:`ToTResult`, the :class:`Tokenizer` protocol, :class:`ByteTokenizer` and :class:`HFTokenizer`);
- :mod:`~treedec.programs.tot.search`: the engine-side work of a search (thoughts generated together,
  evaluations, pruning);
- :mod:`~treedec.programs.tot.game24`: the Game of 24 as a task, with an exact checker.
"""
from treedec.programs.tot.game24 import Game24Task
from treedec.programs.tot.program import ToTProgram, tot_batch, tot_bfs, tot_dfs
from treedec.programs.tot.task import (SELECTIONS, BFSConfig, ByteTokenizer, DFSConfig, HFTokenizer, LevelStats,
                                     ToTResult, ToTState, ToTTask, Tokenizer)

__all__ = ["SELECTIONS", "BFSConfig", "ByteTokenizer", "DFSConfig", "Game24Task", "HFTokenizer", "LevelStats",
           "ToTProgram", "ToTResult", "ToTState", "ToTTask", "Tokenizer", "tot_batch", "tot_bfs", "tot_dfs"]
