"""treedec.LLM, the front door: generate / chat batched through the scheduler, equal to the lower-level programs
and to each request alone; speculative decoding configured on the LLM; beams and program objects on the same
engine; bad input refused before anything runs. The tiny random Llama on the CPU with a small local tokenizer;
the real SmolLM2 checkpoint against transformers (slow, skipped where it cannot be had)."""
import pytest
import torch

from tests.engines import plain_greedy, smollm2_or_skip, tiny_model
from tests.tokenizers_local import build_tokenizer
from treedec import LLM, RequestOutput, SamplingParams, SpeculativeConfig
from treedec.models.text import encode_prompt, load_tokenizer
from treedec.search import GenerateProgram, RequestSpec, beam_search
from treedec.search.speculative import TreeDraft
from treedec.search.tot import BFSConfig, ByteTokenizer, ToTProgram, tot_bfs
from treedec.search.tot.game24 import Game24Task
from treedec.tree.token_tree import TokenTree

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11], [5, 6, 7, 8, 1, 2]]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_tokenizer(build_tokenizer(tmp_path_factory.mktemp("tok")))


def make_llm(tokenizer=None, **kwargs):
    return LLM(tiny_model(), tokenizer, kv_tokens=2048, page_size=4, backend="torch", **kwargs)


def ids(prompt):
    return {"prompt_token_ids": prompt}


def test_greedy_generate_equals_plain_greedy_and_frees_its_pages():
    llm = make_llm()
    outs = llm.generate([ids(p) for p in PROMPTS], SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)
    assert [o.request_id for o in outs] == ["0", "1", "2"] and all(isinstance(o, RequestOutput) for o in outs)
    for out, prompt in zip(outs, PROMPTS):
        [c] = out.outputs
        assert c.token_ids == plain_greedy(tiny_model(), prompt, 10)
        assert (c.finish_reason, c.stop_reason, c.text, out.prompt_token_ids) == ("length", None, None, prompt)
        assert out.stats["steps"] >= 9 and out.stats["tokens_per_step"] > 0
    assert llm.engine.pool.num_free_pages == llm.engine.pool.num_pages


def test_batched_equals_alone_with_a_parameter_list():
    params = [SamplingParams(temperature=0.8, n=3, seed=4, max_tokens=8, logprobs=1),
              SamplingParams(temperature=0, max_tokens=6, repetition_penalty=1.3),
              SamplingParams(temperature=1.1, top_k=20, min_p=0.05, seed=9, max_tokens=7, stop_token_ids=[3])]
    batched = make_llm().generate([ids(p) for p in PROMPTS], params, use_tqdm=False)
    for out, prompt, p in zip(batched, PROMPTS, params):
        [alone] = make_llm().generate(ids(prompt), p, use_tqdm=False)
        assert [c.token_ids for c in out.outputs] == [c.token_ids for c in alone.outputs]
    assert len(batched[0].outputs) == 3 and all(len(c.logprobs) == len(c.token_ids) for c in batched[0].outputs)
    assert batched[0].outputs[0].cumulative_logprob < 0


def test_text_prompts_chat_stop_strings_and_stop_reasons(tokenizer):
    llm = make_llm(tokenizer)
    [out] = llm.generate("The quick brown fox", SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    assert out.prompt == "The quick brown fox" and out.outputs[0].text == tokenizer.decode(
        out.outputs[0].token_ids, skip_special_tokens=True)
    text = out.outputs[0].text
    stop = text.strip()[:2] if text.strip() else None
    if stop:
        [cut] = llm.generate("The quick brown fox", SamplingParams(temperature=0, max_tokens=12, stop=[stop]),
                             use_tqdm=False)
        assert (cut.outputs[0].finish_reason, cut.outputs[0].stop_reason) == ("stop", stop)
        assert stop not in cut.outputs[0].text
    chats = llm.chat([[{"role": "user", "content": "hello"}], [{"role": "user", "content": "stop"}]],
                     SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert [c.prompt for c in chats] == [[{"role": "user", "content": "hello"}], [{"role": "user", "content": "stop"}]]
    assert chats[0].prompt_token_ids == encode_prompt(tokenizer, [{"role": "user", "content": "hello"}], True)


@pytest.mark.parametrize("config", [{"method": "ngram", "num_speculative_tokens": 4},
                                    {"method": "eagle", "model": "random", "num_speculative_tokens": 3},
                                    {"method": "medusa", "model": "random", "medusa_choices": [[0], [0, 0], [1]]}])
def test_speculative_greedy_equals_plain(config):
    plain = make_llm().generate([ids(p) for p in PROMPTS], SamplingParams(temperature=0, max_tokens=12),
                                use_tqdm=False)
    spec = make_llm(speculative=config).generate([ids(p) for p in PROMPTS],
                                                 SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert all("accepted" in o.stats for o in spec)


def test_a_fixed_tree_on_a_repeating_prompt_accepts_several_tokens_a_step():
    prompt = PROMPTS[0]
    greedy = plain_greedy(tiny_model(), prompt, 12)
    tree = TreeDraft(TokenTree.from_medusa_choices([[0], [0, 0], [0, 0, 0]]), lambda context: greedy[:3])
    llm = make_llm(speculative=SpeculativeConfig(method="tree", tree=tree))
    [out] = llm.generate(ids(prompt), SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    assert out.outputs[0].token_ids == greedy


def test_speculative_sampling_runs_seeded_and_refuses_what_it_cannot_do():
    llm = make_llm(speculative={"method": "ngram"})
    params = SamplingParams(temperature=0.9, seed=3, max_tokens=10)
    first = llm.generate([ids(p) for p in PROMPTS], params, use_tqdm=False)
    again = llm.generate([ids(p) for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in again]
    for bad, field in [(SamplingParams(n=2), "n"), (SamplingParams(logprobs=1), "logprobs"),
                       (SamplingParams(temperature=0, presence_penalty=0.5), "presence_penalty")]:
        with pytest.raises(ValueError, match=field):
            llm.generate(ids(PROMPTS[0]), bad, use_tqdm=False)
    assert llm.engine.pool.num_free_pages == llm.engine.pool.num_pages and llm.engine.tree.num_nodes == 0


def test_beam_search_and_program_objects_share_the_engine():
    llm = make_llm()
    first, second = llm.beam_search(PROMPTS[1:], beam_width=3, max_tokens=5)
    for result, prompt in zip((first, second), PROMPTS[1:]):
        assert result.sequences == beam_search(make_llm().engine, prompt, 3, 5).sequences
    spec = RequestSpec("g", prompt_ids=tuple(PROMPTS[2]), params=SamplingParams(temperature=0, max_tokens=5))
    task = Game24Task([4, 9, 10, 13], check_steps=False, thought_max_tokens=3, value_max_tokens=2)
    config = BFSConfig(k=2, n=1, depth=2, sampling=SamplingParams(temperature=0.5), seed=1)
    [outputs, tot], stats = llm.run([GenerateProgram(spec, PROMPTS[2]),
                                     ToTProgram(llm.engine, task, ByteTokenizer(), config)])
    assert outputs[0].output_ids == plain_greedy(tiny_model(), PROMPTS[2], 5) and stats.steps >= 4
    alone = tot_bfs(make_llm().engine, task, ByteTokenizer(), config)
    assert [s.thoughts for s in tot.best] == [s.thoughts for s in alone.best]
    assert llm.engine.tree.num_nodes == 0 and llm.engine.pool.num_free_pages == llm.engine.pool.num_pages


@pytest.mark.parametrize("call, error, message", [
    (lambda llm: llm.generate([], use_tqdm=False), ValueError, "prompts is empty"),
    (lambda llm: llm.generate([ids([1]), ids([2])], [SamplingParams()], use_tqdm=False), ValueError,
     "1 entries for 2 prompts"),
    (lambda llm: llm.generate({"tokens": [1]}, use_tqdm=False), ValueError, r"prompts\[0\] must be a text"),
    (lambda llm: llm.generate(ids([1]), {"temperature": 0}, use_tqdm=False), TypeError,
     r"sampling_params\[0\] must be a SamplingParams"),
    (lambda llm: llm.generate("text", use_tqdm=False), ValueError, "needs the checkpoint's tokenizer"),
    (lambda llm: llm.generate(ids([1, 10**6]), use_tqdm=False), ValueError, r"token ids must be in \[0, "),
])
def test_bad_calls_raise_before_anything_runs(call, error, message):
    llm = make_llm()
    with pytest.raises(error, match=message):
        call(llm)
    assert llm.engine.tree.num_nodes == 0 and llm.engine.pool.num_free_pages == llm.engine.pool.num_pages


@pytest.mark.parametrize("config, message", [
    ({"method": "eagle4"}, "method must be one of ngram, medusa, eagle, eagle3, draft_model, tree"),
    ({"method": "eagle3"}, "method 'eagle3' needs model"),
    ({"method": "ngram", "model": "x"}, "method 'ngram' has no weights"),
    ({"method": "tree"}, "method 'tree' needs tree=TreeDraft"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an int >= 1"),
    ({"method": "draft_model", "model": "random"}, "needs a real draft model"),
])
def test_bad_speculative_configs(config, message):
    with pytest.raises(ValueError, match=message):
        make_llm(speculative=config)


def test_bad_constructor_arguments():
    with pytest.raises(TypeError, match="model must be a model name or path"):
        LLM(3)
    with pytest.raises(TypeError, match="speculative must be a SpeculativeConfig"):
        make_llm(speculative="ngram")
    with pytest.raises(ValueError, match="kv_tokens must be an int >= 1"):
        LLM(tiny_model(), kv_tokens=0)
    with pytest.raises(ValueError, match="a loaded model keeps its own"):
        LLM(tiny_model(), device="cpu")


@pytest.mark.slow
def test_real_checkpoint_greedy_and_logprobs_equal_transformers():
    """LLM("smollm2") (SmolLM2-135M-Instruct, fp32, CPU): a chat's greedy answer and its logprobs equal
    transformers' generate with output_scores (greedy: the scores are the raw logits) within 1e-4, and the
    speculative LLM gives the same tokens."""
    from transformers import AutoModelForCausalLM
    checkpoint = smollm2_or_skip()
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    llm = LLM("smollm2", device="cpu", kv_tokens=4096)
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=2)
    [out] = llm.chat(chat, params, use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    prompt = torch.tensor([out.prompt_token_ids])
    ref = hf.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=12,
                      output_scores=True, return_dict_in_generate=True, pad_token_id=hf.config.eos_token_id)
    tokens = ref.sequences[0, prompt.shape[1]:].tolist()
    c = out.outputs[0]
    assert c.token_ids == tokens
    scores = torch.stack(ref.scores)[:, 0].double().log_softmax(dim=-1)
    for step, (entry, token) in enumerate(zip(c.logprobs, tokens)):
        assert len(entry) in (2, 3) and entry[token].rank == 1
        for t, lp in entry.items():
            assert abs(lp.logprob - scores[step, t].item()) < 1e-4
    spec = LLM("smollm2", device="cpu", kv_tokens=4096, speculative={"method": "ngram"})
    [fast] = spec.chat(chat, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    assert fast.outputs[0].token_ids == tokens and fast.outputs[0].text == c.text


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_llm_on_a_gpu_speculative_equals_plain():
    """LLM on a GPU (bf16, CUDA graphs, pipelined steps): greedy n-gram and EAGLE speculative decoding give plain
    greedy's tokens; logprobs come back for every token."""
    from treedec.models import from_config
    model = from_config("tiny", seed=0, dtype=torch.bfloat16, device="cuda")
    plain = LLM(model, kv_tokens=8192).generate([ids(p) for p in PROMPTS],
                                                SamplingParams(temperature=0, max_tokens=16, logprobs=1),
                                                use_tqdm=False)
    assert all(len(o.outputs[0].logprobs) == 16 for o in plain)
    for config in ({"method": "ngram"}, {"method": "eagle", "model": "random"}):
        spec = LLM(model, kv_tokens=8192, speculative=config).generate(
            [ids(p) for p in PROMPTS], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]


@pytest.mark.parametrize("speculative", [None, {"method": "ngram", "num_speculative_tokens": 3}])
def test_prefix_caching_across_calls_reads_the_last_conversation_with_equal_outputs(speculative):
    """enable_prefix_caching keeps prompts and conversations across generate calls: a second call re-sending the
    first's prompt and answer reads them (whole pages of 4, all but the answer's last token) and answers as an
    LLM without the cache does."""
    params = SamplingParams(max_tokens=9, temperature=0)
    cached, plain = make_llm(enable_prefix_caching=True, speculative=speculative), make_llm(speculative=speculative)
    first = cached.generate(ids(PROMPTS[0]), params, use_tqdm=False)[0]
    follow = {"prompt_token_ids": list(first.prompt_token_ids) + list(first.outputs[0].token_ids) + [7, 8, 9]}
    [again], [alone] = cached.generate(follow, params, use_tqdm=False), plain.generate(follow, params, use_tqdm=False)
    assert again.outputs[0].token_ids == alone.outputs[0].token_ids
    assert again.stats["cached_tokens"] == (len(first.prompt_token_ids) + 9 - 1) // 4 * 4
    assert alone.stats["cached_tokens"] == 0
    assert cached.prefix_cache.num_pages > 0 and cached.engine.tree.num_nodes == 0
    cached.prefix_cache.clear()
    assert cached.engine.pool.num_free_pages == cached.engine.pool.num_pages
