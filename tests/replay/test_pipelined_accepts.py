"""The recorder's pipelined accepts (treedec.replay.pipelined_accepts) by hand: token trees kept from step to step by
advance_token_trees, as the verify group keeps them, written as accepts and token trees of fresh handles; the
replay's tree equals the run's after every step, named by ScheduleRecorder.handle."""
import numpy as np
import pytest
import torch

from treedec.engine import Engine
from treedec.errors import RecordingError
from treedec.models import from_config
from treedec.replay.recorder import ScheduleRecorder
from treedec.workloads.schedule import Accept, TokenTree
from tests.replay.recording import ops_of, prompt, record, replay_steps

CHAIN = [-1, 0, 1]   # a token tree of depth 2: its root and whole path fill a reservation of 3


def two_verified_trees(engine):
    """Two prompts, each with a verified chain tree under it: (leaves, trees [2, 3])."""
    tree = engine.tree
    leaves = [engine.prefill(prompt(14, 6)).node, engine.prefill(prompt(15, 5)).node]
    trees = np.array([tree.add_token_tree(leaves[0], [5, 6, 7], CHAIN),
                      tree.add_token_tree(leaves[1], [8, 9, 10], CHAIN)], dtype=np.int64)
    engine.step()
    return leaves, trees


def accepted(tree, leaf, tokens):
    """The ids of the leaf's last tokens, the accepted root and path (the verify group reads them a step later)."""
    tree.set_tokens(leaf, tree.node_length(leaf) - len(tokens), tokens)


def drafted(tree, nodes, tokens):
    for node, token in zip(nodes, tokens):
        tree.set_tokens(int(node), 0, [token])


def test_kept_trees_replay_as_accepts_and_trees_of_fresh_handles():
    """Step 2 as VerifyGroup._regrow: tree b (of another size) pruned, tree a advanced, then b's reservation, one
    copy filling both (b's slots first); step 3 both advance. Each accept is the verified tree's whole path; each
    kept tree's new handles are "<id>.<k>"."""
    def run(engine):
        tree, pool = engine.tree, engine.pool
        (a, b), trees = two_verified_trees(engine)
        slots = tree.first_slots(trees.reshape(-1)).reshape(2, 3)
        tree.prune_many(trees[1:, 0])
        dst_a = tree.advance_token_trees(trees[:1], np.zeros(1, dtype=np.int64), 3)
        dst_b = tree.extend_computed_many([b], 3)
        pool.copy_slots(torch.as_tensor(np.concatenate([slots[1], slots[0]])),
                        torch.as_tensor(np.concatenate([dst_b[0], dst_a[0]])))
        accepted(tree, a, [5, 6, 7])
        accepted(tree, b, [8, 9, 10])
        drafted(tree, trees[0], [11, 12, 13])
        tb = tree.add_token_tree(b, [14, 15, 16], CHAIN)   # (b's new tree, hung after the copy)
        engine.step()
        kept = np.array([trees[0], tb], dtype=np.int64)
        slots = tree.first_slots(kept.reshape(-1)).reshape(2, 3)
        dst = tree.advance_token_trees(kept, np.zeros(2, dtype=np.int64), 3)
        pool.copy_slots(torch.as_tensor(slots.reshape(-1)), torch.as_tensor(dst.reshape(-1)))
        accepted(tree, a, [11, 12, 13])
        accepted(tree, b, [14, 15, 16])
        drafted(tree, kept.reshape(-1), [17, 18, 19, 20, 21, 22])
        engine.step()
        return trees[1, 0], kept

    schedule, shots, final, (first_b, kept) = record(run, token_ids=True)
    ra, rb = kept[:, 0].tolist()
    assert [[op.op for op in step] for step in schedule.steps] == [
        ["prompt"], ["prompt"], ["token_tree", "token_tree"], ["accept", "token_tree", "accept", "token_tree"],
        ["accept", "token_tree", "accept", "token_tree"]]   # (each reservation's accept, then its kept tree)
    assert [op.ids[0] for op in ops_of(schedule, Accept)] == [ra, first_b, f"{ra}.1", rb]
    assert [op.ids[0] for op in ops_of(schedule, TokenTree)] == [ra, first_b, f"{ra}.1", rb, f"{ra}.2", f"{rb}.1"]
    replay_steps(schedule, shots, final)   # the same trees and tokens after every step


def test_an_unused_reserved_slot_is_cut_by_the_advance_after():
    """A path shorter than the reservation leaves a slot the schedule has not: the next advance must cut it (a cut
    short of it is refused before it runs), and cutting it is no op."""
    engine = Engine(from_config("tiny", seed=0, dtype=torch.float32, device="cpu"), kv_tokens=256, page_size=4,
                    backend="torch")
    recorder = ScheduleRecorder(engine, token_ids=True)
    tree, pool = engine.tree, engine.pool
    (a, b), trees = two_verified_trees(engine)
    slots = tree.first_slots(trees.reshape(-1)).reshape(2, 3)
    dst = tree.advance_token_trees(trees, np.zeros(2, dtype=np.int64), 3)
    with pytest.raises(RecordingError, match="only into the 6 slot"):
        pool.copy_slots(torch.as_tensor(slots.reshape(-1)), torch.as_tensor(dst[:, ::-1].reshape(-1).copy()))
    src = slots[:, [0, 1, 0]]   # the roots and one token each accepted: one reserved slot left each
    pool.copy_slots(torch.as_tensor(src.reshape(-1)), torch.as_tensor(dst.reshape(-1)))
    engine.step()
    length = tree.node_length(a)
    with pytest.raises(RecordingError, match=f"grows node {a}, which holds 1 reserved slot"):
        tree.advance_token_trees(trees, np.zeros(2, dtype=np.int64), 3)
    assert tree.node_length(a) == length   # nothing changed
    tree.advance_token_trees(trees, np.ones(2, dtype=np.int64), 0)   # (the cut alone: the trees hung again)
    engine.step()
    assert recorder.handle(int(trees[0, 0])) == f"{trees[0, 0]}.2" and recorder.handle(a) == a
    tree.prune_many(trees[:, 0])
    steps = [[op.op for op in step] for step in recorder.close().steps]
    assert steps == [["prompt"], ["prompt"], ["token_tree", "token_tree"], ["accept", "token_tree", "accept",
                                                                            "token_tree"],
                     ["prune", "token_tree", "prune", "token_tree"], ["prune", "prune"]]
