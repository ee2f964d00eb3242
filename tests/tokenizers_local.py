"""Small real tokenizers built offline and saved as checkpoint folders (tests only).

Two kinds, the two a Llama-family checkpoint ships:

- ``"byte_bpe"``: byte-level BPE (GPT-2 / Llama 3 / Qwen style): every byte is a token, and
  merges cross character boundaries, so one token may end inside a multi-byte character;
- ``"sentencepiece"``: BPE over characters with SentencePiece's "▁" for spaces, byte fallback
  (``<0xE6>`` tokens) for characters outside its vocabulary, and a decoder that drops the
  leading space of a decoded text (Llama 2 / Mistral style).

Both put ``<s>`` (BOS) before an encoded text and have ``</s>`` (EOS, id 2) as a special token.
"""
from __future__ import annotations

import json
from pathlib import Path

CORPUS = [
    "The quick brown fox jumps over the lazy dog. Stop here, then go on.",
    "Hello world! hello there, stop; STOP and the end.",
    "café crème brûlée à la carte, naïve façade",
    "日本語のテキスト 日本 東京 こんにちは世界",
    "emoji 🎉🚀 party 👍 and more 🎉",
    "newlines\nand\ttabs\n\nand numbers 12345 67890",
]
#: A chat template in the style of Zephyr's: BOS, then each message after a role marker.
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}"
                 "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
                 "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
                 "<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
SPECIALS = ["<unk>", "<s>", "</s>"]
KINDS = ("byte_bpe", "sentencepiece")


def build_tokenizer(folder: Path, kind: str = "byte_bpe", chat_template: bool = True) -> Path:
    """Train a small tokenizer of ``kind`` on :data:`CORPUS` and save it into ``folder`` (created)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    if kind == "byte_bpe":
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(CORPUS, trainer)
    elif kind == "sentencepiece":
        tok = _sentencepiece_like()
    else:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   clean_up_tokenization_spaces=False)
    if chat_template:
        fast.chat_template = CHAT_TEMPLATE
    folder.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(folder))
    return folder


def _sentencepiece_like():
    """BPE trained on the ASCII text of the corpus only, so every other character goes through
    byte fallback; "▁" stands for a space and the decoder strips the text's leading one."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=SPECIALS)
    tok.train_from_iterator([line.encode("ascii", "ignore").decode() for line in CORPUS], trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for byte in range(256):  # the byte-fallback tokens <0x00> .. <0xFF>, as ordinary tokens
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = None
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return tok
