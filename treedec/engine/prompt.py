"""A prompt checked and cut into the steps that compute it: the one prefill path.

:meth:`Engine.chunk_prompt <treedec.engine.Engine.chunk_prompt>` checks a prompt and returns its
:class:`PromptChunks`; the caller adds chunk after chunk to the tree (:meth:`PromptChunks.add`) and
computes each with a step before adding the next: :meth:`Engine.prefill` runs those steps itself,
a scheduler program (:meth:`ProgramContext.prompt <treedec.runtime.program.ProgramContext.prompt>`)
yields them, so that one step computes the chunks of many requests.
"""
from __future__ import annotations

from dataclasses import dataclass

from treedec.tree import SequenceTree


@dataclass(frozen=True)
class PromptChunks:
    """A checked prompt's tokens in the chunks its steps compute.

    Attributes
    ----------
    parent : the node the prompt goes under (a continuation), or None for a new tree of the forest.
    pieces : the prompt's tokens, in chunks of at most the engine's ``prefill_chunk`` (none empty).
    first_position : the position of the prompt's first token (the parent's sequence length).
    pages : the KV pages the prompt takes (from a fresh page).
    """

    parent: int | None
    pieces: tuple[tuple[int, ...], ...]
    first_position: int
    pages: int

    @property
    def num_tokens(self) -> int:
        return sum(map(len, self.pieces))

    @property
    def last_position(self) -> int:
        """The position of the prompt's last token."""
        return self.first_position + self.num_tokens - 1

    def add(self, tree: SequenceTree, chunk: int, node: int | None = None) -> int:
        """Make chunk ``chunk`` the prompt's pending tokens in ``tree``: chunk 0 makes the prompt's node (a
        new root, or a new child of :attr:`parent`), a later chunk extends ``node`` (what chunk 0 returned),
        once the step before has computed the chunk before. Returns the prompt's node."""
        piece = list(self.pieces[chunk])
        if chunk == 0:
            return tree.add_prompt(piece) if self.parent is None else tree.branch(self.parent, [piece])[0]
        if node is None:
            raise ValueError(f"chunk {chunk} extends the prompt's node: pass the node chunk 0 returned")
        tree.extend(node, piece)
        return node
