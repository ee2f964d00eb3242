"""Medusa drafts: the draft's token trees from the heads' candidates, and greedy speculative decoding
with Medusa drafts (tiny model, CPU) equal to plain greedy decoding. The heads' network and checkpoints
are tested in tests/models/test_medusa_heads.py."""
import numpy as np
import pytest
import torch

from treedec.engine import greedy
from treedec.models import from_config
from treedec.models.medusa import MedusaHeads
from treedec.programs.speculative.medusa import DEFAULT_MEDUSA_CHOICES, MedusaDraft
from treedec.programs.speculative.drafts import TargetOutput
from treedec.programs.speculative.program import speculative_generate
from tests.engines import make_engine, plain_greedy, tiny_model
from tests.programs.speculative.test_speculative_program import prompt_with_repeats

NEW_TOKENS = 32


@pytest.fixture(scope="module")
def tiny():
    return tiny_model()


@pytest.fixture(scope="module")
def reference(tiny):
    prompt = prompt_with_repeats()
    return prompt, plain_greedy(tiny, prompt, NEW_TOKENS + 8)


# ================================================================ the draft source


class FixedHeads(MedusaHeads):
    """Heads whose logits are a fixed table, whatever the hidden state."""

    def __init__(self, table):
        super().__init__(128, 512, len(table), num_layers=0)
        self.table = torch.tensor(table, dtype=torch.float32)

    def forward(self, hidden):
        return self.table.expand(*hidden.shape[:-1], *self.table.shape)


def test_draft_tokens_follow_the_choice_ranks():
    table = np.zeros((3, 512), dtype=np.float32)
    for head in range(3):
        table[head, [10 * head + 1, 10 * head + 2, 10 * head + 3]] = [3.0, 2.0, 1.0]   # ranks 0, 1, 2
    choices = [[0], [2], [0, 1], [2, 0], [0, 1, 2]]      # rank 1 of head 0 skipped
    draft = MedusaDraft(FixedHeads(table.tolist()), choices)
    draft.observe(TargetOutput([7, 8, 9], torch.zeros(128)))
    tree, tokens = draft.propose([7, 8, 9])
    assert tree.parents == (-1, 0, 0, 1, 2, 3)
    # [0] -> head 0 rank 0; [2] -> head 0 rank 2; [0,1] -> head 1 rank 1; [2,0] -> head 1 rank 0; [0,1,2]
    assert tokens == [9, 1, 3, 12, 11, 23]


def test_draft_errors(tiny):
    heads = MedusaHeads.untrained(tiny, num_heads=2)
    with pytest.raises(ValueError, match=r"choices path \[0, 0, 0\] is 3 deep but there are 2 Medusa heads"):
        MedusaDraft(heads, [[0], [0, 0], [0, 0, 0]])
    with pytest.raises(ValueError, match=r"choices path \[1, 0\] has no parent path \[1\]"):
        MedusaDraft(heads, [[0], [1, 0]])
    with pytest.raises(ValueError, match=r"choices path \[600\] asks for a candidate rank >= the vocabulary size 512"):
        MedusaDraft(heads, [[600]])
    with pytest.raises(TypeError, match="heads must be MedusaHeads"):
        MedusaDraft(torch.nn.Linear(2, 2), [[0]])
    draft = MedusaDraft(heads, [[0], [0, 0]])
    with pytest.raises(ValueError, match="needs the target's hidden state for this sequence"):
        draft.propose([1, 2, 3])
    other = make_engine(from_config(tiny.config.__class__.from_name("tiny", vocab_size=256), dtype=torch.float32,
                                    device="cpu"))
    with pytest.raises(ValueError, match="heads are for hidden size 128 and vocabulary 512, the target model has "
                                         "128 and 256"):
        speculative_generate(other, [1, 2, 3], draft, 4)
    assert other.tree.num_nodes == 0     # refused before the prefill


# ================================================================ speculative decoding


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_medusa_speculative_equals_plain_greedy(tiny, reference, page_size):
    prompt, ref = reference
    engine = make_engine(tiny, page_size=page_size)
    draft = MedusaDraft(MedusaHeads.untrained(tiny, num_heads=4))
    tokens, stats = speculative_generate(engine, prompt, draft, NEW_TOKENS)
    assert tokens == ref[:NEW_TOKENS]
    assert stats.draft_sizes == [len(DEFAULT_MEDUSA_CHOICES)] * stats.steps
    engine.tree.check_invariants()
    engine.tree.prune(stats.node)
    assert engine.pool.num_free_pages == engine.pool.num_pages


class OracleHeads(MedusaHeads):
    """Heads that know the greedy continuation: they find the position by its hidden state
    (nearest of the reference run's) and predict the reference tokens after the root."""

    def __init__(self, states, continuation, num_heads=4):
        super().__init__(128, 512, num_heads, num_layers=0)
        self.states, self.continuation = states, continuation

    def forward(self, hidden):
        rows = hidden.reshape(-1, hidden.shape[-1])
        out = torch.zeros(len(rows), self.num_heads, 512)
        for r, state in enumerate(rows):
            k = int((self.states - state).norm(dim=-1).argmin())    # the root is continuation[k]
            for i in range(self.num_heads):
                if k + 1 + i < len(self.continuation):
                    out[r, i, self.continuation[k + 1 + i]] = 1.0
        return out.reshape(*hidden.shape[:-1], self.num_heads, 512)


def test_medusa_reads_the_hidden_state_of_the_last_accepted_token(tiny, reference):
    """With heads that are right whenever they get the right hidden state, every step
    accepts a whole path of the deepest choice ([0, 0, 0, 0]): 4 draft tokens."""
    prompt, ref = reference
    engine = make_engine(tiny)
    prefilled = engine.prefill(prompt, return_hidden=True)
    states, out = [prefilled.hidden], [int(greedy(prefilled.logits))]
    while len(out) < NEW_TOKENS + 8:
        engine.tree.extend(prefilled.node, out[-1:])
        step = engine.step(return_hidden=True)
        states.append(step.hidden[0])
        out.append(int(greedy(step.logits[0])))
    assert out == ref
    heads = OracleHeads(torch.stack(states), ref)
    for in_step in (True, False):   # the heads inside the verification step, or after it
        engine = make_engine(tiny)
        tokens, stats = speculative_generate(engine, prompt, MedusaDraft(heads, in_step=in_step), NEW_TOKENS)
        assert tokens == ref[:NEW_TOKENS]
        assert stats.accepted[:-1] == [4] * (stats.steps - 1) and stats.tokens_per_step > 4
        assert engine.row_heads == (("draft",) if in_step else ())
        assert engine.stats["steps"] == stats.steps + 1      # the prefill and the verification steps only


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("compile_model", [False, True])
def test_medusa_heads_in_the_captured_step_equal_heads_after_it(compile_model):
    """Medusa heads inside the verification step's CUDA graph (and its torch.compile) draft the
    same tokens as heads run after the step; every verification step is a graph replay."""
    from treedec.engine import Engine
    from treedec.workloads.deft import medusa_tree

    model = from_config("tiny", seed=0, dtype=torch.bfloat16, device="cuda")
    heads = MedusaHeads(model.config.hidden_size, model.config.vocab_size, 4, dtype=torch.bfloat16, device="cuda")
    prompt = np.random.default_rng(3).integers(0, model.config.vocab_size, 1000).tolist()
    choices = medusa_tree(64).paths
    runs = []
    for in_step in (False, True):
        engine = Engine(model, kv_tokens=8192, page_size=16, cuda_graphs=True, compile_model=compile_model)
        # (unpipelined both: the pipelined loop's own GPU test is in test_pipeline.py; its plans
        # chunk the sequence differently, so bf16 rounding may flip a random model's near-tied argmax)
        tokens, stats = speculative_generate(engine, prompt, MedusaDraft(heads, choices, in_step=in_step), 40,
                                             pipeline=False)
        assert not [k for k in engine.graph_stats if k.startswith("eager") and "max_queries" not in k]
        assert engine.graph_stats["replays"] >= stats.steps
        runs.append(tokens)
    assert runs[0] == runs[1]
