#!/usr/bin/env python3
"""Beam search on treedec: the live beams are leaves of one decoding tree, all computed in one
engine step; dropped beams free their pages at once. On the random tiny model (CPU, fp32) the
result is checked against transformers' ``generate(num_beams=...)`` on the same weights.

    python examples/beam_search.py                                       # random tiny model
    python examples/beam_search.py --model smollm2 --prompt "The capital of France is"

``--model`` takes what ``treedec``'s commands take (a known name, a .gguf file, a checkpoint
folder, a hub repo id in the local cache; ``--config``, ``--device``, ``--dtype`` too).
"""
from __future__ import annotations

import argparse
import time

import torch

from treedec.commands.args import add_model_arguments, load_model, positive_int, seed_int
from treedec.engine import Engine
from treedec.models import from_hf_model, load_tokenizer
from treedec.programs.beam import beam_search


def random_tiny_llama(seed: int = 0):
    """A tiny transformers Llama with random weights ~ N(0, 0.2) (peaked next-token distributions)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=256,
                         attn_implementation="eager")
    hf = LlamaForCausalLM(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.1 * noise if "norm" in name else 0.2 * noise)
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    return hf.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser, config_help="a named model size with random weights (default: a random tiny "
                                            "transformers Llama, to compare with transformers' beam search)")
    parser.add_argument("--prompt", default="Tree attention reads a shared prefix once because")
    parser.add_argument("--beams", type=positive_int, default=4)
    parser.add_argument("--max-tokens", type=positive_int, default=16)
    parser.add_argument("--seed", type=seed_int, default=0, help="random weights (default 0)")
    parser.add_argument("--length-penalty", type=float, default=1.0)
    parser.add_argument("--eos", type=int, help="EOS token id (default: the tokenizer's; none for the tiny model)")
    parser.add_argument("--early-stopping", choices=["false", "true", "never"], default="false")
    args = parser.parse_args()
    early_stopping = {"false": False, "true": True, "never": "never"}[args.early_stopping]

    hf, tokenizer, eos = None, None, args.eos
    if args.model is not None:
        model, _ = load_model(args)
        tokenizer = load_tokenizer(args.model)
        prompt_ids = tokenizer(args.prompt)["input_ids"]
        eos = tokenizer.eos_token_id if eos is None else eos
    elif args.config is not None:
        model, _ = load_model(args)
        prompt_ids = [ord(c) % model.config.vocab_size for c in args.prompt]
    else:
        hf = random_tiny_llama(args.seed)
        model = from_hf_model(hf)
        prompt_ids = [ord(c) % model.config.vocab_size for c in args.prompt]
    cuda = model.device.type == "cuda"
    engine = Engine(model, kv_tokens=None if cuda else 8192)

    t0 = time.perf_counter()
    result = beam_search(engine, prompt_ids, args.beams, args.max_tokens, length_penalty=args.length_penalty,
                         eos_token_id=eos, early_stopping=early_stopping)
    elapsed = time.perf_counter() - t0
    s = result.stats
    print(f"{args.beams} beams, {s.steps + 1} steps in {elapsed:.2f} s; peak {s.peak_pages} KV pages of "
          f"{engine.pool.page_size} tokens (prompt: {engine.pool.pages_for(len(prompt_ids))})")
    for seq, score in zip(result.sequences, result.scores):
        print(f"{score:9.4f}  {tokenizer.decode(seq) if tokenizer else seq}")

    if hf is not None:
        out = hf.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                          num_beams=args.beams, do_sample=False, max_new_tokens=args.max_tokens,
                          length_penalty=args.length_penalty, eos_token_id=eos, early_stopping=early_stopping,
                          num_return_sequences=args.beams, return_dict_in_generate=True, output_scores=True)
        lengths = (out.beam_indices >= 0).sum(dim=1).tolist()
        ref = [out.sequences[i, len(prompt_ids):len(prompt_ids) + n].tolist() for i, n in enumerate(lengths)]
        gap = max(abs(a - b) for a, b in zip(result.scores, out.sequences_scores.tolist()))
        print(f"equal to transformers' beam search: {ref == result.sequences} (largest score difference {gap:.1e})")


if __name__ == "__main__":
    main()
