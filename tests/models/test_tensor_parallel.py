"""Tensor parallelism on the CPU: two gloo processes split tiny models; TP=2 == TP=1 (fp32).

One spawn of two ranks runs every scenario (``_worker``) and returns what each rank saw; the
tests below check it. Bad configurations are checked in this process (no group needed).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.models.tp_spawn import spawn_ranks
from treedec.models import ModelConfig
from treedec.models.hf_tensors import rank_slice
from treedec.models.tensor_parallel import TensorParallel, init_tensor_parallel, shard_config, vocab_range

WORLD = 2
TOL = 1e-5   # fp32: TP=2 only regroups the sums of o_proj and down_proj (seen: 4e-7)


# ===================================================================== the two ranks


def _worker(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        tp = TensorParallel()
        seed = tp.seed_alike()
        results = {"seed": seed}
        _scenarios(tp, Path(out), results)
        torch.save(results, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _scenarios(tp: TensorParallel, out: Path, results: dict) -> None:
    from safetensors.torch import save_file

    from treedec.engine import Engine
    from treedec.models import from_config, from_pretrained, to_hf_config, to_hf_state_dict
    from treedec.programs.beam import beam_search
    from treedec.programs.speculative.draft_model import DraftModelDraft
    from treedec.models.medusa import MedusaHeads
    from treedec.programs.speculative.medusa import MedusaDraft
    from treedec.programs.parallel_sampling import parallel_sample
    from treedec.sampling.params import SamplingParams
    from treedec.programs.greedy import greedy_generate
    from treedec.programs.speculative.program import speculative_generate

    def engine(model, page_size=4):
        return Engine(model, kv_tokens=2048, page_size=page_size, backend="torch", prefill_chunk=16)

    f32 = dict(dtype=torch.float32, device="cpu")
    # Random weights: each rank cuts its slices of from_config's weights.
    full = from_config("tiny", seed=0, **f32)
    split = from_config("tiny", seed=0, tensor_parallel=tp, **f32)
    results["shard_config"] = split.config
    results["weight_bytes"] = (split.weight_bytes(), full.weight_bytes())
    plain, parallel = engine(full), engine(split)
    results["trees"] = _compare_trees(plain, parallel, tp)
    c = split.config
    results["pool_heads"] = parallel.pool.k.shape[-2]
    mine = (3, tp.rank * c.num_kv_heads, c.num_kv_heads)   # [layers, pages, page, heads, dim]: this rank's heads
    results["kv_rel"] = max(_rel(parallel.pool.k, plain.pool.k.narrow(*mine)),
                            _rel(parallel.pool.v, plain.pool.v.narrow(*mine)))
    results["full_head"] = _rel(split.lm_head.weight, full.lm_head.weight)   # the gathered head
    # torch.compile traces the collectives into one graph (fullgraph: no break), as compile_model needs.
    rows = torch.arange(7)
    with torch.no_grad():
        eager = split.forward_graph(rows, rows, _dense_attend).logits
        compiled = torch.compile(lambda t: split.forward_graph(t, t, _dense_attend).logits, fullgraph=True,
                                 backend="aot_eager")(rows)
    results["compiled"] = _rel(compiled, eager)

    # A checkpoint with biases everywhere, a tied head and a vocabulary that 2 does not divide.
    config = ModelConfig.from_name("tiny", vocab_size=509, tie_word_embeddings=True, qkv_bias=True, o_bias=True,
                                   mlp_bias=True)
    biased = from_config(config, seed=3, **f32)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, p in biased.named_parameters():
            if name.endswith(".bias") or name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
    ckpt = out / "ckpt"
    if tp.rank == 0:   # two shard files and an index: each rank reads its slices of both
        ckpt.mkdir()
        state = {k: v.contiguous().clone() for k, v in to_hf_state_dict(biased).items() if k != "lm_head.weight"}
        names = sorted(state)
        files = {"a.safetensors": names[::2], "b.safetensors": names[1::2]}
        for file, keys in files.items():
            save_file({k: state[k] for k in keys}, str(ckpt / file))
        index = {"weight_map": {k: file for file, keys in files.items() for k in keys}}
        (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
        to_hf_config(config).save_pretrained(ckpt)
    tp.gather_objects(None)   # the checkpoint is written
    loaded = from_pretrained(ckpt, tensor_parallel=tp, **f32)
    results["tied_is_view"] = loaded.lm_head.weight_shard.data_ptr() == \
        loaded.embed_tokens.weight[loaded.lm_head.start].data_ptr()
    results["checkpoint_trees"] = _compare_trees(engine(biased, page_size=1), engine(loaded, page_size=1), tp)

    # Programs: the same tokens as TP=1, on both ranks.
    prompt = np.random.default_rng(5).integers(0, 512, 13).tolist()
    results["greedy"] = (greedy_generate(engine(split), prompt, 24), greedy_generate(engine(full), prompt, 24))
    draft = DraftModelDraft(engine(from_config("tiny", seed=1, tensor_parallel=tp, **f32)), depth=3, top_k=2,
                            total_tokens=10)
    results["speculative"] = speculative_generate(engine(split), prompt, draft, 24)[0]
    self_draft = DraftModelDraft(engine(split), depth=3, top_k=2, total_tokens=10)
    results["speculative_self"] = speculative_generate(engine(split), prompt, self_draft, 24)[0]
    heads = [MedusaHeads.untrained(m, num_heads=4, seed=2) for m in (split, full)]   # copies of the whole lm_head
    results["medusa_heads"] = _rel(heads[0].medusa_head[0][-1].weight, heads[1].medusa_head[0][-1].weight)
    results["medusa"] = speculative_generate(engine(split), prompt, MedusaDraft(heads[0]), 24)[0]
    beams = [beam_search(engine(m), prompt, 3, 8) for m in (split, full)]
    results["beam"] = [(b.sequences, b.scores) for b in beams]
    params = SamplingParams(temperature=1.0, top_k=50)
    results["sampled"] = [[s.tokens for s in parallel_sample(engine(m), prompt, 4, 12, params,
                                                             generator=torch.Generator().manual_seed(7)).samples]
                          for m in (split, full)]
    # Unseeded draws come from the global generator, which seed_alike seeded alike.
    results["sampled_global"] = [s.tokens for s in parallel_sample(engine(split), prompt, 4, 12, params).samples]
    # Tree of thought (sampled thoughts, greedy values) and a replayed recorded tree, split and whole.
    from tests.programs.tot.test_tot_search import CharTokenizer, ScriptedTask
    from treedec.replay import ReplayConfig, replay
    from treedec.programs.tot import BFSConfig, tot_bfs
    from treedec.workloads import workload_schedule
    config = BFSConfig(k=2, n=2, depth=2, sampling=SamplingParams(temperature=0.8), seed=3)
    results["tot"] = [[(s.thoughts, s.value) for s in tot_bfs(engine(m), ScriptedTask(values=[0.5, 0.9, 0.2, 0.7]),
                                                               CharTokenizer(), config).best] for m in (split, full)]
    schedule = workload_schedule("medusa-32", iterations=3, prompt_tokens=40)
    results["replay"] = [replay(m, schedule, ReplayConfig(planner="flatten", page_size=4, backend="torch")).emitted
                         for m in (split, full)]

    # The launcher-level benchmark, on these two ranks.
    from bench import tp_step
    args = tp_step.parse_args(["--smoke", "--reps", "1", "--prompt", "40", "--out", str(out)])
    results["bench"] = tp_step.measure(tp, args)

    # bench/programs.py --tensor-parallel 2 on these two ranks (rank 0 writes the results)
    from bench import programs
    results["out"] = str(out)
    results["programs_rc"] = programs.main(["--smoke", "--methods", "eager", "--programs", "greedy,tree_verify",
                                            "--steps", "2", "--tensor-parallel", "2", "--out", str(out / "programs")])


def _compare_trees(plain, parallel, tp) -> dict:
    """The same edits on both engines: the largest relative error of the TP engine's logits and hidden
    states against the plain engine's, after checking each is bitwise equal on every rank."""
    from treedec.workloads.deft import medusa_tree

    rng = np.random.default_rng(2)
    prompt, second = rng.integers(0, 509, 37).tolist(), rng.integers(0, 509, 9).tolist()  # 37: 3 prefill steps
    kids, more, tail = ([[int(t)] for t in rng.integers(0, 509, n)] for n in (3, 3, 2))
    medusa = medusa_tree(64)
    tree_tokens = rng.integers(0, 509, medusa.size).tolist()
    outputs = []
    for engine in (plain, parallel):
        out = []
        root, other = engine.prefill(prompt), engine.prefill(second)    # a forest of two prompts
        out += [root.logits, other.logits]
        branches = engine.tree.branch(root.node, kids)
        step = engine.step(return_hidden=True)
        out += [step.logits, step.hidden]
        engine.tree.extend_many({**dict(zip(branches, more)), other.node: [t for [t] in tail]})
        out.append(engine.step().logits)
        ids = engine.tree.add_token_tree(root.node, tree_tokens, medusa.parents)   # a speculative token tree
        step = engine.step(logits_rows=engine.pending_rows(ids), return_hidden=True)
        out += [step.logits, step.hidden]
        engine.tree.prune(ids[0])
        outputs.append(out)
    for t in outputs[1]:
        tp.check_replicated(t, "a step's output")
    return {"rel": max(_rel(a, b) for a, b in zip(outputs[1], outputs[0])), "steps": len(outputs[1]),
            "replicated": True}


def _dense_attend(layer, q, k, v):
    """Causal attention over the step's own rows (no cache): enough for a model's forward to trace."""
    group = q.shape[1] // k.shape[1]
    q, k, v = (x.transpose(0, 1) for x in (q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """Both ranks' results of every scenario (one spawn for the module)."""
    return spawn_ranks(_worker, tmp_path_factory.mktemp("tp"), WORLD)


# ===================================================================== tests


def test_each_rank_holds_its_heads_and_columns(ranks):
    for r in ranks:
        c = r["shard_config"]
        assert (c.num_heads, c.num_kv_heads, c.intermediate_size, c.vocab_size) == (2, 1, 128, 512)
        assert r["pool_heads"] == 1   # the KV pool holds this rank's KV head only
        split, full = r["weight_bytes"]
        assert split < 0.7 * full     # all but the embedding and norms split
    assert all(r["tied_is_view"] for r in ranks)   # a tied head's shard is a view of the embedding


def test_tp2_logits_equal_tp1(ranks):
    """Prefill (chunked), a forest, branches, extend_many and a 64-token speculative tree: the logits
    and hidden states of TP=2 are TP=1's, bitwise equal on both ranks; each rank's K/V are TP=1's of
    its heads."""
    for r in ranks:
        for key in ("trees", "checkpoint_trees"):
            assert r[key]["rel"] < TOL and r[key]["replicated"] and r[key]["steps"] == 7, (key, r[key])
        assert r["kv_rel"] < TOL
        assert r["full_head"] == 0.0
        assert r["compiled"] < TOL


def test_programs_on_tp_equal_tp1_and_agree_across_ranks(ranks):
    tp_greedy, reference = ranks[0]["greedy"]
    assert tp_greedy == reference and len(reference) == 24
    for r in ranks:
        assert r["greedy"] == (reference, reference)
        assert r["speculative"] == reference and r["speculative_self"] == reference and r["medusa"] == reference
        assert r["medusa_heads"] == 0.0
        assert r["beam"][0][0] == r["beam"][1][0]
        np.testing.assert_allclose(r["beam"][0][1], r["beam"][1][1], rtol=1e-5)
        assert r["sampled"][0] == r["sampled"][1]
    assert ranks[0]["sampled"] == ranks[1]["sampled"]
    assert ranks[0]["sampled_global"] == ranks[1]["sampled_global"]
    for r in ranks:
        assert r["tot"][0] == r["tot"][1] and r["replay"][0] == r["replay"][1] and len(r["replay"][0]) > 0
    assert ranks[0]["tot"] == ranks[1]["tot"] and ranks[0]["replay"] == ranks[1]["replay"]
    assert ranks[0]["seed"] == ranks[1]["seed"]


def test_tp_step_bench_runs_on_gloo(ranks):
    bench = ranks[0]["bench"]
    assert bench["tensor_parallel"] == 2 and bench["backend"] == "gloo" and bench["tree_tokens"] == 64
    eager = bench["methods"]["eager"]
    assert eager["tp_ms"] > 0 and len(eager["per_rank_ms"]) == 2 and eager["tp1_ms"] > 0
    assert eager["rel_err_vs_tp1"] < 1e-5
    assert "tp1_ms" not in ranks[1]["bench"]["methods"]["eager"]   # rank 0 alone runs TP=1
    from bench.tp_step import render_table
    assert "| eager |" in render_table(bench)


# ===================================================================== bad configurations (no group)


def test_programs_bench_runs_split(ranks):
    """bench/programs.py --tensor-parallel 2: both ranks ran every program; rank 0 wrote the per-rank floors."""
    assert [r["programs_rc"] for r in ranks] == [0, 0]
    [path] = Path(ranks[0]["out"]).glob("programs/*-programs-smoke-tp2.json")
    results = json.loads(path.read_text())
    assert results["tensor_parallel"] == 2 and {r["program"] for r in results["runs"]} == {"greedy", "tree_verify"}
    assert results["kv_bytes_per_token"] == 2 * 2 * 1 * 64 * 4   # tiny: 2 layers, 1 of 2 KV heads a rank, fp32


@pytest.mark.parametrize("overrides, size, match", [
    (dict(num_heads=4, num_kv_heads=2), 4, r"num_kv_heads \(2\) divisible by 4"),
    (dict(num_heads=6, num_kv_heads=3), 2, r"num_kv_heads \(3\) divisible by 2"),
    (dict(intermediate_size=258), 4, None),   # kv heads first
    (dict(num_heads=4, num_kv_heads=4, intermediate_size=258), 4, r"intermediate_size \(258\) divisible by 4"),
])
def test_bad_splits_name_the_values(overrides, size, match):
    config = ModelConfig.from_name("tiny", **overrides)
    with pytest.raises(ValueError, match=match or "num_kv_heads"):
        shard_config(config, size)


@pytest.mark.parametrize("size", [0, -1, 1.5, True])
def test_bad_sizes(size):
    with pytest.raises(ValueError, match="tensor-parallel size must be an int >= 1"):
        shard_config(ModelConfig.from_name("tiny"), size)


def test_no_process_group_is_a_clear_error(monkeypatch):
    with pytest.raises(RuntimeError, match="init_process_group"):
        TensorParallel()
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match="torchrun"):
        init_tensor_parallel()


def test_from_config_refuses_other_tensor_parallel_values():
    from treedec.models import from_config
    with pytest.raises(TypeError, match="TensorParallel"):
        from_config("tiny", dtype=torch.float32, device="cpu", tensor_parallel=2)


def test_slices_cover_every_tensor_once():
    """Every rank's slices of each split tensor tile it; the vocabulary too when the size does not divide it."""
    config = ModelConfig.from_name("tiny", vocab_size=509, qkv_bias=True, o_bias=True, mlp_bias=True)
    assert [vocab_range(509, 3, r) for r in range(3)] == [(0, 170), (170, 340), (340, 509)]
    assert vocab_range(5, 4, 3) == (5, 5)
    for name, dim, whole in [("model.layers.1.self_attn.q_proj.weight", 0, 256),
                             ("model.layers.0.self_attn.k_proj.bias", 0, 128),
                             ("model.layers.0.self_attn.o_proj.weight", 1, 256),
                             ("model.layers.0.mlp.up_proj.weight", 0, 256),
                             ("model.layers.0.mlp.down_proj.weight", 1, 256), ("lm_head.weight", 0, 509)]:
        cuts = [rank_slice(name, config, 2, r) for r in range(2)]
        assert {c[0] for c in cuts} == {dim} and cuts[0][1] == 0 and cuts[0][2] == cuts[1][1] \
            and cuts[1][2] == whole, (name, cuts)
    for name in ("model.layers.0.self_attn.o_proj.bias", "model.layers.0.mlp.down_proj.bias",
                 "model.embed_tokens.weight", "model.norm.weight", "model.layers.0.input_layernorm.weight"):
        assert rank_slice(name, config, 2, 1) is None
