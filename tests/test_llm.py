"""treedec.LLM, the front door: generate / chat batched through the scheduler, equal to the lower-level programs
and to each request alone; speculative decoding configured on the LLM; beams and program objects on the same
engine; bad input refused before anything runs. The tiny random Llama on the CPU with a small local tokenizer;
the real SmolLM2 checkpoint against transformers (slow, skipped where it cannot be had)."""
import pytest
import torch

from tests.engines import plain_greedy, smollm2_or_skip, tiny_model
from tests.tokenizers_local import build_tokenizer
from treedec import LLM, BeamSearchOutput, BeamSearchParams, RequestOutput, SamplingParams, SpeculativeConfig
from treedec.models.text import encode_prompt, load_tokenizer
from treedec.programs import GenerateProgram, beam_search
from treedec.runtime import RequestSpec
from treedec.programs.speculative import TreeDraft
from treedec.programs.tot import BFSConfig, ByteTokenizer, ToTProgram, tot_bfs
from treedec.programs.tot.game24 import Game24Task
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
    spec = make_llm(speculative_config=config).generate([ids(p) for p in PROMPTS],
                                                 SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert all("accepted" in o.stats for o in spec)


def test_a_fixed_tree_on_a_repeating_prompt_accepts_several_tokens_a_step():
    prompt = PROMPTS[0]
    greedy = plain_greedy(tiny_model(), prompt, 12)
    tree = TreeDraft(TokenTree.from_medusa_choices([[0], [0, 0], [0, 0, 0]]), lambda context: greedy[:3])
    llm = make_llm(speculative_config=SpeculativeConfig(method="tree", tree=tree))
    [out] = llm.generate(ids(prompt), SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    assert out.outputs[0].token_ids == greedy


def test_speculative_sampling_runs_seeded_and_refuses_what_it_cannot_do():
    llm = make_llm(speculative_config={"method": "ngram"})
    params = SamplingParams(temperature=0.9, seed=3, max_tokens=10, min_p=0.05, presence_penalty=0.3)
    first = llm.generate([ids(p) for p in PROMPTS], params, use_tqdm=False)
    again = llm.generate([ids(p) for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in again]
    penalized = SamplingParams(temperature=0, max_tokens=10, repetition_penalty=1.3, frequency_penalty=0.5,
                               logprobs=2)
    plain = make_llm().generate([ids(p) for p in PROMPTS], penalized, use_tqdm=False)
    spec = llm.generate([ids(p) for p in PROMPTS], penalized, use_tqdm=False)
    for s, p in zip(spec, plain):   # greedy acceptance with penalties: plain greedy's tokens, the target's logprobs
        assert s.outputs[0].token_ids == p.outputs[0].token_ids
        assert s.outputs[0].cumulative_logprob == pytest.approx(p.outputs[0].cumulative_logprob, abs=1e-3)
        assert [sorted(e) for e in s.outputs[0].logprobs] == [sorted(e) for e in p.outputs[0].logprobs]
    for bad, field in [(SamplingParams(n=2), "n"), (SamplingParams(temperature=0, min_tokens=2), "min_tokens")]:
        with pytest.raises(ValueError, match=field):
            llm.generate(ids(PROMPTS[0]), bad, use_tqdm=False)
    assert llm.engine.pool.num_free_pages == llm.engine.pool.num_pages and llm.engine.tree.num_nodes == 0


def test_beam_search_and_program_objects_share_the_engine():
    llm = make_llm()
    first, second = llm.beam_search(PROMPTS[1:], BeamSearchParams(beam_width=3, max_tokens=5))
    for result, prompt in zip((first, second), PROMPTS[1:]):
        alone = beam_search(make_llm().engine, prompt, 3, 5)
        assert [s.tokens for s in result.sequences] == [prompt + seq for seq in alone.sequences]
        assert [s.score for s in result.sequences] == pytest.approx(alone.scores, abs=1e-5)   # (batched: float noise)
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
    (lambda llm: llm.generate(ids([1, 10**6]), use_tqdm=False), ValueError, r"token id 1000000 is out of vocabulary \(the model's vocabulary has "),
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
        make_llm(speculative_config=config)


def test_bad_constructor_arguments():
    with pytest.raises(TypeError, match="model must be a model name or path"):
        LLM(3)
    with pytest.raises(TypeError, match="speculative_config must be a dict of SpeculativeConfig's fields"):
        make_llm(speculative_config="ngram")
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
    spec = LLM("smollm2", device="cpu", kv_tokens=4096, speculative_config={"method": "ngram"})
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
        spec = LLM(model, kv_tokens=8192, speculative_config=config).generate(
            [ids(p) for p in PROMPTS], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]


@pytest.mark.parametrize("speculative", [None, {"method": "ngram", "num_speculative_tokens": 3}])
def test_prefix_caching_across_calls_reads_the_last_conversation_with_equal_outputs(speculative):
    """enable_prefix_caching keeps prompts and conversations across generate calls: a second call re-sending the
    first's prompt and answer reads them (whole pages of 4, all but the answer's last token) and answers as an
    LLM without the cache does."""
    params = SamplingParams(max_tokens=9, temperature=0)
    cached, plain = make_llm(enable_prefix_caching=True, speculative_config=speculative), make_llm(speculative_config=speculative)
    first = cached.generate(ids(PROMPTS[0]), params, use_tqdm=False)[0]
    follow = {"prompt_token_ids": list(first.prompt_token_ids) + list(first.outputs[0].token_ids) + [7, 8, 9]}
    [again], [alone] = cached.generate(follow, params, use_tqdm=False), plain.generate(follow, params, use_tqdm=False)
    assert again.outputs[0].token_ids == alone.outputs[0].token_ids
    assert again.stats["cached_tokens"] == (len(first.prompt_token_ids) + 9 - 1) // 4 * 4
    assert alone.stats["cached_tokens"] == 0
    assert cached.prefix_cache.num_pages > 0 and cached.engine.tree.num_nodes == 0
    cached.prefix_cache.clear()
    assert cached.engine.pool.num_free_pages == cached.engine.pool.num_pages


# ================================================================ vLLM's arguments (issue 48)


def test_beam_search_takes_vllm_s_prompts_and_params(tokenizer):
    """Was: token ids only, and its own argument list. vLLM's shape: prompts (text, token ids, prompt dicts) and a
    BeamSearchParams; BeamSearchOutput.sequences hold the prompt's tokens and the hypothesis', best first."""
    llm = make_llm(tokenizer)
    text = "The quick brown fox"
    prompt = encode_prompt(tokenizer, text, False)
    params = BeamSearchParams(beam_width=2, max_tokens=4)
    outputs = llm.beam_search([text, {"prompt": text}, {"prompt_token_ids": prompt}, prompt], params)
    assert all(isinstance(o, BeamSearchOutput) and len(o.sequences) == 2 for o in outputs)
    alone = beam_search(make_llm().engine, prompt, 2, 4)
    for out in outputs:
        assert [s.tokens for s in out.sequences] == [prompt + seq for seq in alone.sequences]
        best = out.sequences[0]
        assert best.text == tokenizer.decode(best.tokens, skip_special_tokens=True)
        assert best.finish_reason in ("stop", "length") and best.cum_logprob == pytest.approx(
            best.score * (len(best.tokens) - len(prompt)), rel=1e-6)
    [single] = llm.beam_search(text, params)
    assert [s.tokens for s in single.sequences] == [s.tokens for s in outputs[0].sequences]
    assert llm.engine.pool.num_free_pages == llm.engine.pool.num_pages


@pytest.mark.parametrize("make, error, message", [
    (lambda: BeamSearchParams(beam_width=0, max_tokens=4), ValueError, "beam_width must be an int >= 1"),
    (lambda: BeamSearchParams(beam_width=2, max_tokens=4, temperature=0.7), NotImplementedError, "temperature 0.7"),
    (lambda: BeamSearchParams(beam_width=2, max_tokens=4, early_stopping="sometimes"), ValueError, "early_stopping"),
])
def test_bad_beam_search_params(make, error, message):
    with pytest.raises(error, match=message):
        make()


def test_beam_search_refuses_bad_prompts_before_anything_runs():
    llm = make_llm()
    with pytest.raises(TypeError, match="params must be a BeamSearchParams"):
        llm.beam_search(PROMPTS[0], {"beam_width": 2})
    with pytest.raises(ValueError, match=r"prompts\[0\] is a text: it needs the checkpoint's tokenizer"):
        llm.beam_search("text", BeamSearchParams(beam_width=2, max_tokens=2))
    with pytest.raises(ValueError, match="more than max_model_len 4096"):
        llm.beam_search(PROMPTS[0], BeamSearchParams(beam_width=2, max_tokens=5000))
    assert llm.engine.tree.num_nodes == 0


@pytest.mark.parametrize("name, expected", [("auto", torch.float32), ("float32", torch.float32),
                                            ("float", torch.float32), ("bfloat16", torch.bfloat16),
                                            ("half", torch.float16), ("float16", torch.float16),
                                            (torch.bfloat16, torch.bfloat16)])
def test_string_dtypes(name, expected, monkeypatch):
    """Was: dtype="bfloat16" failed (torch dtypes only). vLLM's names (and "auto": fp32 on the CPU)."""
    seen = {}

    def load(model, dtype, device, quantization):
        seen.update(dtype=dtype, device=device, quantization=quantization)
        return tiny_model()
    monkeypatch.setattr("treedec.llm.from_pretrained", load)
    monkeypatch.setattr("treedec.llm.load_tokenizer", lambda name: None)
    LLM("some-model", dtype=name, device="cpu", kv_tokens=64, backend="torch")
    assert seen == {"dtype": expected, "device": "cpu", "quantization": None}


def test_max_model_len_bounds_requests_and_sizes_the_cpu_pool():
    """Was: refused (TypeError). A request past max_model_len is refused before anything runs; the CPU pool, not
    given, holds one request of max_model_len (was: 32768 tokens whatever the model)."""
    llm = LLM(tiny_model(), max_model_len=100, page_size=4, backend="torch")
    assert llm.max_model_len == 100 and llm.engine.kv_capacity_tokens == 104   # 25 pages and the output's first
    with pytest.raises(ValueError, match=r"request 0 may reach 101 positions .* more than max_model_len 100"):
        llm.generate(ids([1] * 90), SamplingParams(max_tokens=11), use_tqdm=False)
    [out] = llm.generate(ids([1] * 90), SamplingParams(max_tokens=10, temperature=0), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 10
    assert LLM(tiny_model(), page_size=16, backend="torch").engine.kv_capacity_tokens == 4096 + 16   # its context
    with pytest.raises(ValueError, match="max_model_len must be at most the model's 4096 positions, got 5000"):
        LLM(tiny_model(), max_model_len=5000)


def test_gpu_memory_utilization_and_tensor_parallel_size():
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be a number in \(0, 1\], got float 1.5"):
        LLM(tiny_model(), gpu_memory_utilization=1.5)
    assert LLM(tiny_model(), tensor_parallel_size=1, kv_tokens=64, backend="torch").engine is not None
    with pytest.raises(NotImplementedError, match="tensor parallelism runs one process per GPU under torchrun"):
        LLM(tiny_model(), tensor_parallel_size=2)
    with pytest.raises(NotImplementedError, match="torchrun --nproc-per-node 4"):
        LLM("smollm2", tensor_parallel_size=4)   # refused before the weights load


def test_speculative_config_takes_vllm_s_dict_and_refuses_what_it_does_not_know():
    llm = make_llm(speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2})
    assert llm.speculative_config == SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_max=2)
    with pytest.raises(ValueError, match=r"speculative_config has key\(s\) \['prompt_lookup_min'\]"):
        make_llm(speculative_config={"method": "ngram", "prompt_lookup_min": 1})
    with pytest.raises(TypeError, match="'speculative' \\(did you mean 'speculative_config'\\?\\)"):
        make_llm(speculative={"method": "ngram"})


def test_get_tokenizer(tokenizer):
    assert make_llm(tokenizer).get_tokenizer() is tokenizer
    with pytest.raises(ValueError, match="this LLM has no tokenizer"):
        make_llm().get_tokenizer()


def test_a_bad_tokenizer_fails_at_construction():
    """Was: LLM(tokenizer=123) built, then AttributeError at the first generate."""
    with pytest.raises(TypeError, match="tokenizer must be a tokenizer name or folder, or a tokenizer with encode"):
        LLM(tiny_model(), 123)


def test_a_pool_larger_than_memory_is_a_clear_error(monkeypatch):
    """Was: a raw MemoryError from the allocator (or the machine swapping). Checked before allocating."""
    monkeypatch.setattr("treedec.engine.pool_sizing.available_memory", lambda device: 1 << 30)
    with pytest.raises(MemoryError, match=r"out of memory: kv_tokens 1099511627776 asks for a KV pool of .* but 1.0 "
                                          r"GiB is available on cpu; lower kv_tokens \(about 524288 tokens fit\)"):
        LLM(tiny_model(), kv_tokens=2**40)
