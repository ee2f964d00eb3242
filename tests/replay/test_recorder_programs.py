"""ScheduleRecorder on every program kind (tiny random model, CPU): a recording replays to the same tree.

Each run is recorded, then its schedule is replayed by a :class:`ScheduleDriver` on a fresh engine;
after every step the replayed tree must equal the recorded one (each node's parent and tokens, and
the KV pages in use), and once released the replay's pool must be all free. ``token_ids`` records
every token; ``prompt_ids`` leaves decoded tokens to the replay's greedy choices, so a greedy program
must choose the same tokens again.
"""
import numpy as np
import pytest
import torch

from treedec.engine import Engine
from treedec.replay import ReplayConfig, ScheduleDriver, ScheduleRecorder, replay
from treedec.search.batch import generate_batch
from treedec.search.beam import beam_search
from treedec.search.controller import BranchEvery, run_controller
from treedec.search.speculative.draft_model import DraftModelDraft
from treedec.search.speculative.drafts import PromptLookupDraft, TreeDraft
from treedec.models.medusa import MedusaHeads
from treedec.search.speculative.medusa import MedusaDraft
from treedec.search.requests_file import RequestSpec
from treedec.search.parallel_sampling import parallel_sample
from treedec.search.sampling import SamplingParams
from treedec.search.generate import greedy_generate
from treedec.search.speculative.program import speculative_generate
from treedec.search.tot import BFSConfig, ByteTokenizer, ToTTask, tot_bfs
from treedec.tree.token_tree import TokenTree
from treedec.workloads import Accept, Children, Extend, Prompt, TokenTree as TokenTreeOp, Truncate, load_schedule
from tests.engines import tiny_model

PAGE = 4
CHUNK = 8   # prefill_chunk: a longer prompt is computed in several steps


def make_engine(page_size=PAGE):
    return Engine(tiny_model(), kv_tokens=1024, page_size=page_size, backend="torch", prefill_chunk=CHUNK)


def prompt(seed, n):
    return tuple(np.random.default_rng(seed).integers(0, 256, n).tolist())


def snapshot(engine, handle_of=None):
    """The tree as {node: (parent, tokens)} (nodes named by ``handle_of``) and the KV pages in use."""
    tree, name = engine.tree, (lambda n: n) if handle_of is None else handle_of.__getitem__
    nodes = {name(n): (None if tree.parent(n) is None else name(tree.parent(n)), tuple(tree.tokens(n)))
             for r in tree.roots for n in tree.subtree(r)}
    return nodes, engine.pool.num_pages - engine.pool.num_free_pages


class Snapshots:
    """The tree after each engine step and prefill (a prefill's own steps not counted), as the recorder
    ends its steps. Installed before the recorder, which wraps these wrappers and restores them."""

    def __init__(self, engine):
        self.engine, self.taken, self._inside = engine, [], False
        prefill, step = engine.prefill, engine.step

        def snapped_prefill(*args, **kwargs):
            self._inside = True
            try:
                out = prefill(*args, **kwargs)
            finally:
                self._inside = False
            self.taken.append(snapshot(engine))
            return out

        def snapped_step(*args, **kwargs):
            out = step(*args, **kwargs)
            if not self._inside:
                self.taken.append(snapshot(engine))
            return out

        engine.prefill, engine.step = snapped_prefill, snapped_step

    def remove(self):
        del self.engine.prefill, self.engine.step


def record(run, page_size=PAGE, **flags):
    """Run ``run(engine)`` on a fresh engine under a recorder; returns the schedule, the snapshots, the
    tree as the run left it and the run's result."""
    engine = make_engine(page_size)
    shots = Snapshots(engine)
    recorder = ScheduleRecorder(engine, name="test", **flags)
    result = run(engine)
    schedule = recorder.close()
    shots.remove()
    assert engine.step.__func__ is Engine.step and "extend" not in vars(engine.tree)
    return schedule, shots.taken, snapshot(engine), result


def replay_steps(schedule, shots, final, page_size=PAGE, tokens=True):
    """Replay ``schedule``: the tree after each step equals ``shots`` (with ``tokens=False``, their shape
    and pages only), and ``final`` after the last; then every page is freed. Returns each replayed
    node's longest tokens, by handle."""
    engine = make_engine(page_size)
    driver = ScheduleDriver(engine)
    seen: dict = {}
    for i, ops in enumerate(schedule.steps):
        for op in ops:
            driver.apply(op)
        driver.forward()
        now = snapshot(engine, {nid: h for h, nid in driver.nodes.items()})
        for h, (_, toks) in now[0].items():
            seen[h] = max(seen.get(h, ()), toks, key=len)
        want = shots[i] if i < len(shots) else None
        if want is not None and not tokens:
            now, want = _shape(now), _shape(want)
        if want is not None:
            assert now == want, f"step {i}: {[op.op for op in ops]}"
    last = snapshot(engine, {nid: h for h, nid in driver.nodes.items()})
    assert last == final if tokens else _shape(last) == _shape(final)
    driver.release()
    engine.tree.check_invariants()
    assert engine.tree.num_nodes == 0 and engine.pool.num_free_pages == engine.pool.num_pages
    return seen


def _shape(shot):
    nodes, pages = shot
    return {n: (p, len(t)) for n, (p, t) in nodes.items()}, pages


def placed(output, tokens):
    """Whether a node's ``tokens`` hold an output's tokens (its last token, drawn last, is never placed)."""
    return len(output) > 1 and tokens[:len(output) - 1] == tuple(output[:-1])


def ops_of(schedule, kind):
    return [op for step in schedule.steps for op in step if isinstance(op, kind)]


# ================================================================ scheduler programs


def batch_requests(temperature):
    shared = prompt(1, 8)   # two whole pages: one prefix node read by requests 0 and 1
    return [RequestSpec(0, prompt_ids=shared + prompt(2, 5), max_new_tokens=4, temperature=0.0),
            RequestSpec(1, prompt_ids=shared + prompt(3, 3), max_new_tokens=3, temperature=temperature, seed=2, n=2),
            RequestSpec(2, prompt_ids=prompt(4, 20), max_new_tokens=3, temperature=temperature, seed=5)]


@pytest.mark.parametrize("temperature, flags", [(0.0, {"prompt_ids": True}), (1.0, {"token_ids": True})])
def test_generate_batch_with_a_shared_prefix_and_a_chunked_prompt(temperature, flags):
    schedule, shots, final, (results, stats) = record(lambda e: generate_batch(e, batch_requests(temperature)),
                                                      **flags)
    # The shared prefix is prefilled; request 2's prompt is the scheduler's (its first chunk, then two extends);
    # the others continue under the prefix's node.
    prefix, chunked = ops_of(schedule, Prompt)
    assert not prefix.pending and chunked.pending and len(chunked.tokens) == CHUNK
    assert [op.tokens for op in ops_of(schedule, Extend) if op.node == chunked.id][:2] == [prompt(4, 20)[8:16],
                                                                                           prompt(4, 20)[16:]]
    assert stats.shared_prefix_tokens == 8
    seen = replay_steps(schedule, shots, final)
    assert all(any(placed(r.output_ids, toks) for toks in seen.values()) for r in results)


def test_beam_search():
    schedule, shots, final, result = record(lambda e: beam_search(e, prompt(6, 10), 3, 4, eos_token_id=None),
                                            token_ids=True)
    replay_steps(schedule, shots, final)
    assert len(result.sequences) == 3


@pytest.mark.parametrize("temperature, flags", [(0.0, {"prompt_ids": True}), (0.8, {"token_ids": True})])
def test_run_controller(temperature, flags):
    def run(engine):
        return run_controller(engine, prompt(7, 12), BranchEvery(every=2, k=2, max_leaves=4), max_steps=5,
                              temperature=temperature, generator=torch.Generator().manual_seed(3), eos_token_id=None)

    schedule, shots, final, _ = record(run, **flags)
    replay_steps(schedule, shots, final)


def test_parallel_sampling():
    def run(engine):
        return parallel_sample(engine, prompt(8, 9), 3, 4, SamplingParams(temperature=1.0, top_k=20),
                               eos_token_id=None, generator=torch.Generator().manual_seed(1))

    schedule, shots, final, result = record(run, token_ids=True)
    seen = replay_steps(schedule, shots, final)
    assert all(any(placed(s.tokens, toks) for toks in seen.values()) for s in result.samples)


def oracle_tree_draft(text, ahead):
    """A fixed token tree whose all-zeros path is the model's greedy continuation (accepted), the rest random."""
    tree = TokenTree.from_medusa_choices([[0], [1], [0, 0], [0, 1], [0, 0, 0]])
    full, rng = list(text) + ahead, np.random.default_rng(0)

    def tokens(seq):
        rest = full[len(seq):]
        return [rest[len(p) - 1] if not any(p) and len(p) <= len(rest) else int(rng.integers(0, 512))
                for p in tree.paths[1:]]
    return TreeDraft(tree, tokens)


DRAFTS = {
    "fixed-tree": oracle_tree_draft,
    "n-gram": lambda text, ahead: PromptLookupDraft(max_ngram=2, min_ngram=1, num_draft_tokens=3, max_matches=2),
    "medusa": lambda text, ahead: MedusaDraft(MedusaHeads.untrained(tiny_model(), num_heads=4)),
    "draft-model": lambda text, ahead: DraftModelDraft(Engine(tiny_model(), kv_tokens=512, page_size=PAGE,
                                                              backend="torch"), depth=2, top_k=2, total_tokens=4),
}


@pytest.mark.parametrize("name", list(DRAFTS))
def test_speculative_generate(name):
    words = prompt(9, 5)
    text = words + prompt(10, 3) + words   # repeats, for the n-gram draft
    ahead = greedy_generate(make_engine(), text, 12, eos_token_id=None)
    draft = DRAFTS[name](text, ahead)

    schedule, shots, final, (tokens, stats) = record(
        lambda e: speculative_generate(e, text, draft, 8, eos_token_id=None), prompt_ids=True)
    assert tokens == ahead[:8]
    if name in ("fixed-tree", "draft-model"):   # drafts of the model's own choices: some are accepted
        assert ops_of(schedule, Accept)
    assert ops_of(schedule, TokenTreeOp)
    replay_steps(schedule, shots, final)   # greedy: the replay's own choices are the recorded tokens
    node_tokens = next(toks for parent, toks in final[0].values() if parent is None)
    assert node_tokens[len(text):] == tuple(tokens[:len(node_tokens) - len(text)])


def test_tree_of_thought():
    class Task(ToTTask):
        thought_stop, thought_max_tokens, value_max_tokens = (), 3, 2

        def root_prompt(self):
            return "Q: 3 5 7?"

        def step_prompt(self, thoughts):
            return "\nNext:"   # a prompt continued under each state

        def value_prompt(self, thoughts):
            return "\nV:"

        def parse_value(self, thoughts, outputs):
            return float(len(thoughts) + sum(map(len, outputs)))

    config = BFSConfig(k=2, n=2, depth=2, temperature=1.0, seed=4)
    schedule, shots, final, _ = record(lambda e: tot_bfs(e, Task(), ByteTokenizer(), config), token_ids=True)
    replay_steps(schedule, shots, final)


# ================================================================ pipelined decoding


def test_pipelined_greedy_generate_truncates_past_the_end():
    text = prompt(11, 10)
    ahead = greedy_generate(make_engine(), text, 6, eos_token_id=None)
    eos = ahead[3]   # the run stops there, one pipelined step past it

    def run(engine):
        return greedy_generate(engine, text, 6, eos_token_id=eos, pipeline=True)

    for flags in ({"token_ids": True}, {"prompt_ids": True}):
        schedule, shots, final, out = record(run, **flags)
        assert out == ahead[:ahead.index(eos) + 1] and ops_of(schedule, Truncate)
        # The tree holds placeholders until the tokens are read back: compare the shapes step by step, the
        # tokens at the end (the prompt and every new token but the last).
        replay_steps(schedule, shots, final, tokens=False)
        assert final[0] == {0: (None, text + tuple(out[:-1]))}


def test_pipelined_generate_batch():
    def run(engine):
        return generate_batch(engine, batch_requests(1.0), pipeline=True)

    schedule, shots, final, (results, _) = record(run, token_ids=True)
    seen = replay_steps(schedule, shots, final, tokens=False)
    assert all(any(placed(r.output_ids, toks) for toks in seen.values()) for r in results)


# ================================================================ the recorded JSON through replay()


def test_recorded_scheduler_run_replays_from_its_file(tmp_path):
    schedule, *_ = record(lambda e: generate_batch(e, batch_requests(0.0)), prompt_ids=True)
    path = tmp_path / "run.json"
    schedule.save(path)
    loaded = load_schedule(path)
    assert loaded.steps == schedule.steps
    run = replay(tiny_model(), loaded, ReplayConfig(page_size=PAGE, backend="torch"))
    assert run.summary["pages_free_at_end"] and run.summary["decode_steps"] > 0
    assert {s["kind"] for s in run.steps} >= {"prefill", "decode"}


# ================================================================ tree edits no program makes (yet)


def test_children_accept_truncate_pause_and_an_accept_of_plain_nodes():
    def run(engine):
        tree = engine.tree
        root = engine.prefill(prompt(12, 9)).node
        a, b = tree.branch(root, [[5], [6, 7]])
        engine.step()
        tree.pause(b)
        first = tree.add_children([a, a, b], [1, 2, 3])           # one layer of a draft, over two parents
        second = tree.add_children([first[0]], [4])
        engine.step()
        tree.accept(a, iter([first[0], second[0]]))              # a generator path: read once by each
        tree.prune(b)
        tree.extend(a, [8, 9])
        engine.step()
        tree.truncate(a, 2)                                       # drop a's last 3 tokens
        c, d = tree.branch(a, [[10], [11]])
        engine.step()
        tree.accept(a, [c])                                       # plain nodes: pruned, their tokens extended
        tree.extend(a, [12])
        engine.step()

    schedule, shots, final, _ = record(run, token_ids=True)
    assert ops_of(schedule, Children) and ops_of(schedule, Truncate) and len(ops_of(schedule, Accept)) == 1
    replay_steps(schedule, shots[:4], final)


def test_a_prune_after_the_steps_tokens_is_recorded_in_place():
    def run(engine):
        tree = engine.tree
        root = engine.prefill(prompt(13, 6)).node
        a, b = tree.branch(root, [[1], [2]])
        engine.step()
        tree.extend(a, [3])
        tree.prune(b)            # after a's pending token, as a scheduler's retiring program does
        engine.step()

    schedule, shots, final, _ = record(run)
    assert [op.op for op in schedule.steps[2]] == ["extend", "prune"]
    replay_steps(schedule, shots, final, tokens=False)
