"""A prompt checked and cut into the steps that compute it: the one prefill path.

:meth:`Engine.chunk_prompt <treedec.engine.Engine.chunk_prompt>` checks a prompt and returns its
:class:`PromptChunks`; the caller adds chunk after chunk to the tree (:meth:`PromptChunks.add`) and
computes each with a step before adding the next: :meth:`Engine.prefill` runs those steps itself,
a scheduler program (:meth:`ProgramContext.prompt <treedec.runtime.program.ProgramContext.prompt>`)
yields them, so that one step computes the chunks of many requests.
"""
from __future__ import annotations

from dataclasses import dataclass

from treedec.engine.step_checks import check_window
from treedec.engine.step_output import PrefillOutput
from treedec.errors import PoolExhaustedError, TreeError
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


def prefill_steps(engine, prompt_ids, parent, return_hidden, return_heads) -> PrefillOutput:
    """:meth:`Engine.prefill <treedec.engine.Engine.prefill>`'s steps: the prompt checked, chunked, each chunk added
    and computed by a step of its own; the last chunk's last logits (hidden state, heads)."""
    prompt = engine.chunk_prompt(prompt_ids, parent)
    pending = engine.tree.layout().num_queries
    if pending:
        raise TreeError(f"prefill runs its own steps but the tree has {pending} pending token(s); "
                        f"run step() first")
    check_window(engine.window_cap, prompt.last_position)
    if prompt.pages > engine.pool.num_free_pages:
        raise PoolExhaustedError(
            f"KV pool exhausted: the {prompt.num_tokens}-token prompt needs {prompt.pages} page(s) of "
            f"{engine.pool.page_size} tokens, {engine.pool.num_free_pages} of {engine.pool.num_pages} free; "
            f"nothing was changed")
    node = out = None
    for i, piece in enumerate(prompt.pieces):
        node = prompt.add(engine.tree, i, node)
        out = engine.step(logits_rows=[len(piece) - 1], return_hidden=return_hidden, return_heads=return_heads)
    return PrefillOutput(node, out.logits[0], None if out.hidden is None else out.hidden[0],
                         None if out.heads is None else {k: v[0] for k, v in out.heads.items()})
