"""treedec.models.text: a checkpoint's tokenizer, its chat template, streaming detokenization.

The tokenizers are real (transformers fast tokenizers), trained offline on a few sentences
and saved as checkpoint folders (tests/tokenizers_local.py): byte-level BPE, whose tokens may
end inside a multi-byte character, and a SentencePiece-style one with byte fallback, whose
decoder drops a text's leading space.
"""
import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from treedec.models import CheckpointError
from treedec.models.text import IncrementalDetokenizer, check_messages, encode_prompt, load_tokenizer
from treedec.programs.tot import ByteTokenizer
from tests.tokenizers_local import CORPUS, KINDS, build_tokenizer

REPLACEMENT = "\ufffd"
TEXTS = CORPUS + ["Hello café 日本 🎉 stop here", "é", "🎉🎉", " leading space", "a\n\nb"]
# Characters of every UTF-8 length, spaces and punctuation: what random valid outputs are made of.
ALPHABET = "ab xyz.,!\n\té日本語🎉👍ßü"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenizers")
    return {kind: build_tokenizer(root / kind, kind) for kind in KINDS}


@pytest.fixture(scope="module")
def tokenizers(folders):
    return {kind: load_tokenizer(folder) for kind, folder in folders.items()}


def stream(tokenizer, ids, prompt_ids=(), chunk=1):
    """(deltas, the detokenizer) after feeding ``ids`` ``chunk`` at a time and finishing."""
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    deltas = [detok.feed(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    deltas.append(detok.finish())
    return deltas, detok


# ================================================================ load_tokenizer


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tokenizers, kind, text):
    tok = tokenizers[kind]
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id and tok.bos_token_id not in ids[1:]
    assert tok.decode(ids, skip_special_tokens=True) == text


def test_load_tokenizer_reads_local_folder_with_chat_template(tokenizers):
    tok = tokenizers["byte_bpe"]
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    assert "add_generation_prompt" in tok.chat_template


def test_load_tokenizer_not_a_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="never downloads") as e:
        load_tokenizer(tmp_path / "meta-llama/Llama-3-8B")
    assert "Llama-3-8B" in str(e.value)


def test_load_tokenizer_folder_without_tokenizer(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(CheckpointError, match="has no tokenizer") as e:
        load_tokenizer(tmp_path)
    assert str(tmp_path) in str(e.value) and isinstance(e.value, ValueError)


@pytest.mark.parametrize("content", ["{not json", '{"version": "1.0", "model": {"type": "nonsense"}}'])
def test_load_tokenizer_corrupt_file(tmp_path, content):
    (tmp_path / "tokenizer.json").write_text(content)
    with pytest.raises(CheckpointError, match="cannot load its tokenizer") as e:
        load_tokenizer(tmp_path)
    assert str(tmp_path) in str(e.value)


# ================================================================ encode_prompt


@pytest.mark.parametrize("kind", KINDS)
def test_plain_text_gets_the_checkpoint_bos(tokenizers, kind):
    tok = tokenizers[kind]
    ids = encode_prompt(tok, "Hello world!", chat_template=False)
    assert ids == tok.encode("Hello world!") and ids[0] == tok.bos_token_id


@pytest.mark.parametrize("kind", KINDS)
def test_chat_template_renders_messages_with_one_bos(tokenizers, kind):
    tok = tokenizers[kind]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a prime in 日本語."}]
    ids = encode_prompt(tok, messages, chat_template=True)
    rendered = "<s><|system|>\nBe brief.</s>\n<|user|>\nName a prime in 日本語.</s>\n<|assistant|>\n"
    assert ids == tok.encode(rendered, add_special_tokens=False)
    assert ids.count(tok.bos_token_id) == 1 and ids[0] == tok.bos_token_id     # the template's BOS, not doubled
    assert tok.decode(ids, skip_special_tokens=True).endswith("<|assistant|>\n")   # the generation prompt


def test_chat_template_takes_a_text_as_one_user_message(tokenizers):
    tok = tokenizers["byte_bpe"]
    assert encode_prompt(tok, "hi", True) == encode_prompt(tok, [{"role": "user", "content": "hi"}], True)


def test_chat_template_keeps_extra_message_keys(tokenizers):
    tok = tokenizers["byte_bpe"]
    plain = encode_prompt(tok, [{"role": "user", "content": "hi"}], True)
    assert encode_prompt(tok, [{"role": "user", "content": "hi", "name": "ann"}], True) == plain


def test_no_chat_template_is_a_clear_error(tmp_path):
    tok = load_tokenizer(build_tokenizer(tmp_path / "plain", chat_template=False))
    with pytest.raises(ValueError, match="no chat template") as e:
        encode_prompt(tok, "hi", chat_template=True)
    assert str(tmp_path / "plain") in str(e.value)
    assert encode_prompt(tok, "hi", chat_template=False) == tok.encode("hi")       # plain text still works


def test_template_that_refuses_messages(tokenizers):
    with pytest.raises(ValueError, match="refused the messages.*unknown role tool"):
        encode_prompt(tokenizers["byte_bpe"], [{"role": "tool", "content": "42"}], chat_template=True)


@pytest.mark.parametrize("messages, where", [
    ([], "empty list"),
    ({"role": "user", "content": "hi"}, "must be a list of chat messages"),
    (["hi"], r"prompt\[0\] must be a chat message"),
    ([{"role": "user"}], r"prompt\[0\]\['content'\] must be a string, got nothing"),
    ([{"role": "user", "content": "a"}, {"role": 3, "content": "b"}],
     r"prompt\[1\]\['role'\] must be a string, got int 3"),
    ([{"role": "user", "content": ["part"]}], r"prompt\[0\]\['content'\] must be a string, got list"),
])
def test_malformed_messages(tokenizers, messages, where):
    with pytest.raises(ValueError, match=where):
        encode_prompt(tokenizers["byte_bpe"], messages, chat_template=True)


def test_check_messages_names_the_argument():
    assert check_messages(({"role": "user", "content": "x", "name": "a"},)) == [{"role": "user", "content": "x",
                                                                                 "name": "a"}]
    with pytest.raises(ValueError, match=r"messages\[0\]\['role'\]"):
        check_messages([{"content": "x"}])


def test_encode_prompt_argument_errors(tokenizers):
    tok = tokenizers["byte_bpe"]
    with pytest.raises(ValueError, match="need chat_template=True"):
        encode_prompt(tok, [{"role": "user", "content": "hi"}], chat_template=False)
    with pytest.raises(TypeError, match="prompt must be a text.*got int 5"):
        encode_prompt(tok, 5, chat_template=False)
    with pytest.raises(TypeError, match="chat_template must be a bool, got str"):
        encode_prompt(tok, "hi", chat_template="yes")


SURROGATES = [  # (prompt, chat_template, where the error says the surrogate is)
    ("\ud800", False, r"prompt is not text: a lone surrogate \(U\+D800\) at character 0"),
    ("caf\udce9 au lait", False, r"prompt is not text: a lone surrogate \(U\+DCE9\) at character 3"),
    ("\udfff", True, r"prompt is not text: a lone surrogate \(U\+DFFF\)"),
    ([{"role": "user", "content": "ok"}, {"role": "user", "content": "x\ud83d"}], True,
     r"prompt\[1\]\['content'\] is not text: a lone surrogate \(U\+D83D\) at character 1"),
    ([{"role": "user", "content": "ok", "name": "\udc80"}], True, r"prompt\[0\]\['name'\] is not text"),
]


@pytest.mark.parametrize("kind, prompt, chat, where", [(kind, *case) for kind in KINDS + ("bytes",)
                                                       for case in SURROGATES
                                                       if kind != "bytes" or not case[1]])   # bytes: no template
def test_a_lone_surrogate_is_not_a_prompt(tokenizers, kind, prompt, chat, where):
    """Tokenizers raise a TypeError naming nothing for a lone surrogate (a JSON "\\ud800" escape, an argv
    byte that was not UTF-8): encode_prompt says which text, where, and what it is, before encoding."""
    tok = ByteTokenizer() if kind == "bytes" else tokenizers[kind]
    with pytest.raises(ValueError, match=where):
        encode_prompt(tok, prompt, chat_template=chat)


def test_byte_tokenizer_plain_text_only():
    tok = ByteTokenizer()
    assert encode_prompt(tok, "é!", chat_template=False) == [0xC3, 0xA9, 0x21]
    with pytest.raises(ValueError, match="ByteTokenizer has no chat template"):
        encode_prompt(tok, "hi", chat_template=True)
    with pytest.raises(ValueError, match="encodes to no tokens"):
        encode_prompt(tok, "", chat_template=False)


# ================================================================ IncrementalDetokenizer


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("text", TEXTS)
def test_stream_equals_full_decode_and_never_shows_half_a_character(tokenizers, kind, text):
    tok = tokenizers[kind]
    ids = tok.encode(text)
    deltas, detok = stream(tok, ids)
    assert not any(REPLACEMENT in d for d in deltas)
    assert "".join(deltas) == detok.text == text == tok.decode(ids, skip_special_tokens=True)
    assert detok.output_ids == ids and detok.finished


def test_byte_level_tokens_end_inside_characters(tokenizers):
    """The corpus makes byte-level BPE merge across character boundaries: some token of this
    text alone decodes to U+FFFD, yet the stream never shows one."""
    tok = tokenizers["byte_bpe"]
    ids = tok.encode("日本語のテキスト 🎉🚀", add_special_tokens=False)
    assert any(REPLACEMENT in tok.decode([i]) for i in ids)
    deltas, _ = stream(tok, ids)
    assert "".join(deltas) == "日本語のテキスト 🎉🚀" and not any(REPLACEMENT in d for d in deltas)


def test_character_comes_with_its_last_byte():
    detok = IncrementalDetokenizer(ByteTokenizer())
    assert [detok.feed(b) for b in "é🎉".encode()] == ["", "é", "", "", "", "🎉"]
    assert detok.feed([0x61, 0xE6, 0x97]) == "a"       # the whole characters before an incomplete one come at once
    assert detok.feed(0xA5) == "日" and detok.text == "é🎉a日"


def test_finish_shows_bytes_that_never_became_a_character():
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok)
    assert detok.feed([0x61, 0xE6, 0x97]) == "a"
    assert detok.finish() == REPLACEMENT
    assert detok.text == tok.decode([0x61, 0xE6, 0x97]) == "a" + REPLACEMENT
    assert detok.finish() == ""
    with pytest.raises(RuntimeError, match="finished"):
        detok.feed(0x61)


@pytest.mark.parametrize("kind", KINDS)
def test_prompt_context_decodes_the_first_output_token_as_in_the_whole_text(tokenizers, kind):
    """SentencePiece drops the leading space of a decoded text: the output's first token " café"
    decodes alone as "café", but after the prompt it is " café" (and so the stream says)."""
    tok = tokenizers[kind]
    prompt = tok.encode("Hello")
    out = tok.encode("Hello café 日本", add_special_tokens=False)[len(prompt) - 1:]
    whole = tok.decode(prompt + out, skip_special_tokens=True)
    assert whole == "Hello café 日本"
    deltas, detok = stream(tok, out, prompt_ids=prompt)
    assert detok.text == " café 日本" == whole[len("Hello"):]
    assert detok.output_ids == out
    if kind == "sentencepiece":
        assert not tok.decode(out).startswith(" ")       # why the prompt context is needed


def test_prompt_context_starts_at_a_character_boundary(tokenizers):
    """The last 5 prompt tokens start inside 🎉's bytes: the context window steps back to its
    first byte, else byte fallback would show the broken run as U+FFFD and the output never."""
    tok = tokenizers["sentencepiece"]
    prompt, ids = tok.encode("ß🎉"), tok.encode("ß🎉ß")
    assert tok.convert_ids_to_tokens(prompt[-5:])[0] == "<0x9F>" and ids[:len(prompt)] == prompt
    deltas, detok = stream(tok, ids[len(prompt):], prompt_ids=prompt)
    assert deltas == ["", "ß", ""] and detok.text == "ß"


def test_special_tokens_are_skipped_by_default(tokenizers):
    tok = tokenizers["byte_bpe"]
    ids = tok.encode("stop here", add_special_tokens=False) + [tok.eos_token_id]
    assert stream(tok, ids)[1].text == "stop here"
    kept = IncrementalDetokenizer(tok, skip_special_tokens=False)
    kept.feed(ids)
    assert kept.text == "stop here</s>"


@given(data=st.data())
@settings(max_examples=60, deadline=None)
@pytest.mark.parametrize("kind", KINDS + ("bytes",))
def test_any_chunking_streams_the_same_text(tokenizers, kind, data):
    """Random ids (specials, stray bytes) fed in random chunks: the same text as one at a time.
    For byte-level decoders it is also the one-shot decode's text (byte fallback rewrites an
    invalid byte run after the fact: see IncrementalDetokenizer)."""
    tok = ByteTokenizer() if kind == "bytes" else tokenizers[kind]
    vocab = 300 if kind == "bytes" else len(tok)
    ids = data.draw(st.lists(st.integers(0, vocab - 1), max_size=24))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(ids)), max_size=6)))
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.feed(ids[a:b]) for a, b in zip([0] + cuts, cuts + [len(ids)])] + [detok.finish()]
    one_by_one, reference = stream(tok, ids)
    assert "".join(deltas) == detok.text == reference.text == "".join(one_by_one)
    if kind != "sentencepiece":
        assert detok.text == (tok.decode(ids) if kind == "bytes" else tok.decode(ids, skip_special_tokens=True))


@given(text=st.text(alphabet=ALPHABET, max_size=40), prompt=st.text(alphabet=ALPHABET, min_size=1, max_size=10))
@settings(max_examples=60, deadline=None)
@pytest.mark.parametrize("kind", KINDS + ("bytes",))
def test_valid_text_streams_exactly_without_replacement_characters(tokenizers, kind, text, prompt):
    tok = ByteTokenizer() if kind == "bytes" else tokenizers[kind]
    prompt_ids = tok.encode(prompt)
    ids = tok.encode(prompt + text, **({} if kind == "bytes" else {"add_special_tokens": True}))
    split = len(prompt_ids)
    if ids[:split] != prompt_ids:      # BPE merged across the prompt's end: split earlier, between characters
        split -= 1
        while split > 1 and REPLACEMENT in tok.decode(ids[:split]):
            split -= 1
    prompt_ids, out = ids[:split], ids[split:]
    deltas, detok = stream(tok, out, prompt_ids=prompt_ids)
    whole = tok.decode(ids) if kind == "bytes" else tok.decode(ids, skip_special_tokens=True)
    head = tok.decode(prompt_ids) if kind == "bytes" else tok.decode(prompt_ids, skip_special_tokens=True)
    assert whole == prompt + text
    assert not any(REPLACEMENT in d for d in deltas)
    assert detok.text == whole[len(head):]


def test_feed_accepts_numpy_and_torch_ids(tokenizers):
    tok = tokenizers["byte_bpe"]
    ids = tok.encode("café 日本", add_special_tokens=False)
    for given_ids in (np.array(ids), torch.tensor(ids), tuple(ids)):
        detok = IncrementalDetokenizer(tok)
        assert detok.feed(given_ids) == "café 日本"
    detok = IncrementalDetokenizer(tok)
    assert "".join(detok.feed(np.int64(i)) for i in ids) == "café 日本"


def test_feed_checks_every_id_before_feeding_any(tokenizers):
    tok = tokenizers["byte_bpe"]
    detok = IncrementalDetokenizer(tok)
    assert detok.vocab_size == len(tok) == 400
    with pytest.raises(ValueError, match=r"token_ids must be in \[0, 399\], got .*400"):
        detok.feed([5, len(tok)])
    with pytest.raises(ValueError, match="token_ids"):
        detok.feed(-1)
    with pytest.raises(TypeError, match="token_ids"):
        detok.feed("abc")
    with pytest.raises(TypeError, match="token_ids"):
        detok.feed([1.5])
    assert detok.output_ids == [] and detok.text == ""


def test_constructor_errors(tokenizers):
    with pytest.raises(TypeError, match="tokenizer must have a decode"):
        IncrementalDetokenizer(object())
    with pytest.raises(TypeError, match="skip_special_tokens must be a bool"):
        IncrementalDetokenizer(tokenizers["byte_bpe"], skip_special_tokens="no")
    with pytest.raises(ValueError, match="prompt_ids"):
        IncrementalDetokenizer(tokenizers["byte_bpe"], prompt_ids=[3, -2])
    assert IncrementalDetokenizer(ByteTokenizer()).vocab_size is None


def wordpiece_tokenizer():
    """A BERT-style tokenizer: its WordPiece decoder puts a space between every two tokens, added ones included."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "[CLS]": 1, "[SEP]": 2, "hello": 3, "world": 4, "##s": 5}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.Whitespace(), decoders.WordPiece()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]")


def test_spaces_between_special_tokens_as_vllm_applies_it():
    """vLLM's fast-tokenizer rule: with spaces_between_special_tokens=False an added token right after another
    comes as its raw content (no decoder space before it); the first one after a plain token, as decoded."""
    tok = wordpiece_tokenizer()
    ids = [3, 2, 2, 4, 5, 1, 2]
    assert tok.decode(ids) == "hello [SEP] [SEP] worlds [CLS] [SEP]"
    for skip, spaces, text in ((False, True, "hello [SEP] [SEP] worlds [CLS] [SEP]"),
                               (False, False, "hello [SEP][SEP] worlds [CLS][SEP]"),
                               (True, False, "hello worlds"), (True, True, "hello worlds")):
        for chunk in (1, 3):
            detok = IncrementalDetokenizer(tok, [3], skip_special_tokens=skip, spaces_between_special_tokens=spaces)
            for i in range(0, len(ids), chunk):
                detok.feed(ids[i:i + chunk])
            detok.finish()
            assert detok.text == " " + text   # (after the prompt's "hello")
    with pytest.raises(TypeError, match="spaces_between_special_tokens must be a bool"):
        IncrementalDetokenizer(tok, spaces_between_special_tokens=None)


def test_text_from_joins_only_the_tail(tokenizers):
    tok = tokenizers["byte_bpe"]
    detok = IncrementalDetokenizer(tok)
    for i in tok.encode("café 日本 and more", add_special_tokens=False):
        detok.feed(i)
    text = detok.text
    assert detok.text_length == len(text) and all(detok.text_from(k) == text[k:] for k in range(len(text) + 2))
    detok.feed(tok.encode(" end", add_special_tokens=False))
    assert detok.text_from(len(text)) == " end" and detok.text_from(0) == text + " end"


@pytest.mark.parametrize("kind", KINDS)
@given(st.lists(st.integers(0, 10 ** 6), min_size=1, max_size=24))
@settings(max_examples=60, deadline=None)
def test_may_write_holds_for_every_character_a_token_adds(tokenizers, kind, picks):
    """Whatever the ids (broken bytes, special tokens and all), every character a fed token adds to the text is one
    that :meth:`IncrementalDetokenizer.may_write` says it may write (so a stop string is checked where it ends)."""
    tok = tokenizers[kind]
    ids = [p % len(tok) for p in picks]
    detok = IncrementalDetokenizer(tok, tok.encode("Hi"))
    for token in ids:
        for c in set(detok.feed(token)):
            assert detok.may_write(token, frozenset(c)), (kind, token, c, tok.convert_ids_to_tokens(token))


def test_byte_tokenizer_decodes_any_id_sequence():
    tok = ByteTokenizer()
    assert tok.decode([72, 105]) == tok.decode(np.array([72, 105])) == tok.decode(torch.tensor([72, 105])) == "Hi"
    assert tok.decode([0xC3, 0xA9, 300]) == "é" + REPLACEMENT and tok.decode([0xC3]) == REPLACEMENT


@given(ids=st.lists(st.one_of(st.integers(0, 255), st.sampled_from([0x80, 0xBF, 0xC3, 0xE2, 0xED, 0xF0, 0xFF]),
                              st.integers(256, 10**6), st.integers(-3, -1)), max_size=12))
@settings(max_examples=400, deadline=None)
def test_byte_tokenizer_decodes_an_id_past_the_bytes_as_its_own_u_fffd(ids):
    """Each id past the bytes (or below 0) reads as the 3 bytes of U+FFFD, whatever the bytes around it (which it
    ends if they are half a character)."""
    raw = b"".join(bytes((i,)) if 0 <= i < 256 else REPLACEMENT.encode() for i in ids)
    assert ByteTokenizer().decode(ids) == raw.decode("utf-8", errors="replace")


@pytest.mark.parametrize("kind", KINDS)
def test_copies_of_a_fresh_detokenizer_stream_as_new_ones(tokenizers, kind):
    """A request's outputs each get a copy of one fresh detokenizer (its prompt's context decoded once): each streams
    what a new one streams, none sees another's tokens; a fed one is not copied."""
    tok = tokenizers[kind]
    prompt = tok.encode("Hello wörld", add_special_tokens=False)
    texts = ["ab 日本", "é🎉 x", "", "yes\nno"]
    first = IncrementalDetokenizer(tok, prompt)
    copies = [first] + first.copies(len(texts) - 1)
    for detok, text in zip(copies, texts):
        ids = tok.encode(text, add_special_tokens=False)
        deltas, fresh = stream(tok, ids, prompt)
        assert [detok.feed(i) for i in ids] + [detok.finish()] == deltas and detok.text == fresh.text
        assert detok.output_ids == ids
    with pytest.raises(ValueError, match="copies are made of a fresh IncrementalDetokenizer"):
        first.copies(1)
