"""``treedec train-drafter``: train Medusa heads (or an EAGLE-3 drafter) for the user's own model by
self-distillation.

    treedec train-drafter --model smollm2 --method medusa --out medusa-smollm2     # the shipped prompts
    treedec train-drafter --model ./my-model --prompts mine.jsonl --out heads --epochs 2
    treedec train-drafter --model smollm2 --out medusa-smollm2 --resume            # continue a stopped run
    treedec spec --model smollm2 --speculative medusa --medusa medusa-smollm2 --check

Three stages, each with its progress on stderr (:mod:`treedec.train`):

1. distill: the model answers ``--prompts`` (default the shipped :data:`~treedec.train.DEFAULT_PROMPTS`) batched
   through the scheduler (``--temperature`` / ``--top-p`` / ``--max-tokens`` / ``--seed``: how it answers; a
   prompts line's own parameters win), and its hidden states at every answer position go to ``OUT/data/`` in
   shards (``--shard-tokens`` rows each: memory holds one);
2. train: Medusa-1 heads (``--num-heads`` heads of ``--num-layers`` ResBlocks, the output layers initialised from
   ``lm_head``, the model frozen) on the next tokens of the model's own answers; AdamW; the trainer's state in
   ``OUT/trainer_state.pt`` every ``--save-every`` steps (``--resume`` continues from it, on the same data);
3. evaluate: on ``--heldout`` prompts (default the shipped :data:`~treedec.train.HELDOUT_PROMPTS`, first
   ``--eval-prompts`` of them), greedy speculative decoding with the trained heads and Medusa's 64-token tree
   against plain greedy decoding: tokens a step, accepted lengths, equal tokens, speedup.

``OUT`` then holds the heads in Medusa's layout (``medusa_lm_head.safetensors``, ``config.json``: what ``treedec
spec --medusa OUT``, ``SpeculativeConfig(method="medusa", model=OUT)`` and ``treedec serve --speculative medusa
--medusa OUT`` load), ``loss.png`` (the loss curve), ``acceptance.json`` and ``train.json`` (the run: times,
losses, settings).

``--method eagle3`` keeps the inputs of three target layers (low, middle, high) and the prompts' rows too, trains
an EAGLE-3 drafter with its training-time test (``--ttt-steps``) over a draft vocabulary of the answers' most
frequent tokens (``--draft-vocab-size``), saves it in EAGLE's / SGLang's layout (``config.json``,
``model.safetensors`` with ``d2t`` / ``t2d``: ``treedec spec --speculative eagle3 --drafter OUT``,
``SpeculativeConfig(method="eagle3", model=OUT)``, ``treedec serve --speculative eagle3 --drafter OUT``), and
measures it with EAGLE-2 trees (``--depth``, ``--draft-top-k``, ``--total-tokens``). Not resumable yet.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from treedec.commands.args import (add_model_arguments, backend_arg, check_backend, existing_file, load_model,
                                   nonnegative_float, nonnegative_int, positive_float, positive_int, seed_int,
                                   unit_fraction)
from treedec.commands.requests_file import read_requests
from treedec.models.eagle_config import default_aux_layers
from treedec.models.eagle_drafter import load_eagle, save_eagle
from treedec.models.medusa import load_medusa_heads
from treedec.models.text import has_tokenizer, load_tokenizer
from treedec.programs.speculative.medusa import DEFAULT_MEDUSA_CHOICES
from treedec.sampling.params import SamplingParams
from treedec.train import (DEFAULT_PROMPTS, HELDOUT_PROMPTS, DistillConfig, MedusaTrainConfig, distill,
                           evaluate_medusa, read_manifest, save_medusa_heads, train_medusa)
from treedec.train.eagle3 import Eagle3TrainConfig, train_eagle3
from treedec.train.evaluate import choices_for, evaluate_eagle3
from treedec.train.medusa import STATE_FILE

METHODS = ("medusa", "eagle3")


def add_train_drafter_parser(sub) -> None:
    p = sub.add_parser("train-drafter", help="train Medusa heads or an EAGLE-3 drafter for a model on its own answers "
                                             "(self-distillation)",
                       description="Self-distillation: the model answers the prompts, its hidden states are kept, "
                                   "Medusa heads learn its next tokens; the heads are saved in Medusa's layout and "
                                   "measured on held-out prompts.")
    add_model_arguments(p)
    p.add_argument("--method", choices=METHODS, default="medusa",
                   help="medusa (Medusa-1 heads, default) or eagle3 (an EAGLE-3 drafter, trained with its "
                        "training-time test)")
    p.add_argument("--out", required=True, type=_out_dir,
                   help="the output folder (made if missing; its parent must exist)")
    p.add_argument("--prompts", type=existing_file, default=str(DEFAULT_PROMPTS),
                   help="training prompts, a prompts JSONL file as treedec generate's (default: the shipped "
                        f"{DEFAULT_PROMPTS.name}, {_lines(DEFAULT_PROMPTS)} instructions)")
    p.add_argument("--heldout", type=existing_file, default=str(HELDOUT_PROMPTS),
                   help=f"held-out prompts for the evaluation (default: the shipped {HELDOUT_PROMPTS.name})")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --out (its data and trainer state; the same settings)")
    g = p.add_argument_group("distillation")
    g.add_argument("--max-prompts", type=positive_int, help="use the first N training prompts only")
    g.add_argument("--max-tokens", type=positive_int, default=128, help="answer tokens at most (default 128)")
    g.add_argument("--temperature", type=nonnegative_float, default=0.0, help="how the model answers (default 0: "
                                                                               "greedy, what greedy decoding verifies)")
    g.add_argument("--top-p", type=unit_fraction, default=1.0, help="with --temperature > 0 (default 1)")
    g.add_argument("--no-chat-template", action="store_true",
                   help="send text prompts as they are (default: through the tokenizer's chat template)")
    g.add_argument("--shard-tokens", type=positive_int, default=16384, help="rows a data shard holds (default 16384)")
    g.add_argument("--batch-tokens", type=positive_int, default=2048,
                   help="tokens a hidden-state step runs (default 2048)")
    g = p.add_argument_group("training")
    g.add_argument("--num-heads", type=positive_int, default=4, help="Medusa heads (default 4)")
    g.add_argument("--num-layers", type=positive_int, default=1, help="ResBlocks a head (default 1)")
    g.add_argument("--epochs", type=positive_int, default=1, help="passes over the data (default 1)")
    g.add_argument("--max-steps", type=positive_int, help="stop after this many steps in all (resumable)")
    g.add_argument("--batch-size", type=positive_int, default=128, help="answer positions a step (default 128)")
    g.add_argument("--lr", type=positive_float,
                   help="peak learning rate (default 1e-3 for medusa, 3e-4 for eagle3)")
    g.add_argument("--weight-decay", type=nonnegative_float, default=0.0, help="AdamW's (default 0)")
    g.add_argument("--freeze-output-layers", action="store_true",
                   help="keep every head's vocabulary projection the lm_head copy (a third less compute)")
    g.add_argument("--save-every", type=positive_int, default=50, help="steps between trainer states (default 50)")
    g.add_argument("--draft-vocab-size", type=positive_int, default=8192,
                   help="eagle3: the draft vocabulary (the tokens the answers hold most often; default 8192)")
    g.add_argument("--ttt-steps", type=positive_int, default=5,
                   help="eagle3: training-time-test steps (the drafter's own features fed back; default 5)")
    g = p.add_argument_group("evaluation")
    g.add_argument("--eval-prompts", type=nonnegative_int, default=8,
                   help="held-out prompts to measure acceptance on (default 8; 0: no evaluation)")
    g.add_argument("--eval-max-tokens", type=positive_int, default=64, help="tokens per held-out answer (default 64)")
    g.add_argument("--medusa-choices", type=_choices_name, default="mc_sim_7b_63",
                   help="the evaluation's tree: mc_sim_7b_63 (Medusa's 64-token tree, default) or default (treedec "
                        "spec's 10-token tree)")
    g.add_argument("--depth", type=positive_int, default=5, help="eagle3: the evaluation trees' depth (default 5)")
    g.add_argument("--draft-top-k", type=positive_int, default=8, help="eagle3: their expansion width (default 8)")
    g.add_argument("--total-tokens", type=positive_int, default=63, help="eagle3: their draft tokens (default 63)")
    p.add_argument("--backend", type=backend_arg, default="auto", help="auto, reference, torch, triton or cuda")
    p.add_argument("--seed", type=seed_int, default=0, help="random weights (--config), sampling, the batch order")
    p.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")


def run_train_drafter(args: argparse.Namespace) -> int:
    """Run ``treedec train-drafter``; returns the exit code (1 when the drafted tokens differ from plain greedy
    decoding's on a held-out prompt)."""
    out = Path(args.out)
    data_dir = out / "data"
    state = out / STATE_FILE
    if args.method == "eagle3" and args.resume:
        raise ValueError("--resume continues Medusa training; an EAGLE-3 run is not resumable yet (run it again)")
    if not args.resume and state.exists():
        raise ValueError(f"{out} holds a training run ({STATE_FILE}); pass --resume to continue it, or another --out")
    if args.resume and not state.exists():
        raise ValueError(f"--resume: {out} holds no training run ({STATE_FILE} is missing)")
    if args.method == "medusa":
        train_config = MedusaTrainConfig(num_heads=args.num_heads, num_layers=args.num_layers, epochs=args.epochs,
                                         max_steps=args.max_steps, batch_size=args.batch_size,
                                         lr=1e-3 if args.lr is None else args.lr,
                                         weight_decay=args.weight_decay,
                                         train_output_layers=not args.freeze_output_layers,
                                         save_every=args.save_every, seed=args.seed % 2**31)
    else:
        train_config = Eagle3TrainConfig(draft_vocab_size=args.draft_vocab_size, ttt_steps=args.ttt_steps,
                                         epochs=args.epochs, batch_tokens=args.batch_tokens,
                                         lr=3e-4 if args.lr is None else args.lr, weight_decay=args.weight_decay,
                                         seed=args.seed % 2**31)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens,
                            seed=args.seed if args.temperature > 0 else None)
    requests = read_requests(args.prompts)[:args.max_prompts]
    heldout = read_requests(args.heldout)[:args.eval_prompts] if args.eval_prompts else []
    check_backend(args)
    model, name = load_model(args)
    aux_layers = default_aux_layers(model.config.num_layers) if args.method == "eagle3" else ()
    distill_config = DistillConfig(params=params, chat_template=not args.no_chat_template, aux_layers=aux_layers,
                                   shard_tokens=args.shard_tokens, batch_tokens=args.batch_tokens,
                                   progress=not args.no_progress)
    tokenizer = load_tokenizer(args.model) if args.model is not None and has_tokenizer(args.model) else None
    if tokenizer is None and any(r.prompt_ids is None for r in requests + heldout):
        raise ValueError(f"{name} has no tokenizer: the prompts files must give prompt_ids (token ids), not text")
    out.mkdir(exist_ok=True)
    data_dir.mkdir(exist_ok=True)
    what = "Medusa heads" if args.method == "medusa" else "an EAGLE-3 drafter"
    print(f"train-drafter: {what} for {name} ({str(model.dtype).removeprefix('torch.')} on {model.device}); "
          f"{len(requests)} training prompts from {args.prompts}", file=sys.stderr)

    began = time.perf_counter()
    summary = None
    if args.resume:
        manifest = read_manifest(data_dir)
        print(f"resume: {manifest.rows} rows of {manifest.sequences} answers in {data_dir}", file=sys.stderr)
    else:
        summary = distill(model, requests, data_dir, distill_config, tokenizer, name, backend=args.backend)
        manifest = summary.manifest
        print(f"distill: {manifest.sequences} answers, {summary.answer_tokens} tokens in "
              f"{summary.generate_seconds:.1f} s, hidden states in {summary.forward_seconds:.1f} s, "
              f"{len(manifest.shards)} shard(s)", file=sys.stderr)
    report = {"command": "train-drafter", "method": args.method, "model": name, "device": str(model.device),
              "dtype": str(model.dtype).removeprefix("torch."), "prompts": args.prompts,
              "answers": manifest.sequences, "rows": manifest.rows, "config": dataclasses.asdict(train_config),
              "distill_seconds": None if summary is None else round(summary.generate_seconds +
                                                                    summary.forward_seconds, 1)}
    if args.method == "medusa":
        result = train_medusa(model, data_dir, out, train_config, resume=args.resume, progress=not args.no_progress)
        weights = save_medusa_heads(result.heads, out, name, dtype=model.dtype)
        report.update(steps=result.steps, total_steps=result.total_steps, resumed_from=result.resumed_from,
                      last_head_accuracy=result.head_accuracy[-1] if result.head_accuracy else None)
    else:
        result = train_eagle3(model, data_dir, train_config, progress=not args.no_progress)
        weights = save_eagle(result.drafter, out)
        report.update(steps=result.steps, last_accuracy=result.accuracy[-1] if result.accuracy else None)
    _plot_losses(result.losses, out / "loss.png", name, args.method)
    report.update(train_seconds=round(result.seconds, 1), first_loss=result.losses[0] if result.losses else None,
                  last_loss=result.losses[-1] if result.losses else None)
    print(f"train: {result.steps} steps, loss {report['first_loss']:.3f} -> {report['last_loss']:.3f} in "
          f"{result.seconds:.1f} s; saved in {weights}", file=sys.stderr)
    if heldout:
        common = dict(chat_template=not args.no_chat_template, backend=args.backend, progress=not args.no_progress)
        if args.method == "medusa":
            heads = load_medusa_heads(out, model)   # what the other tools will load
            choices = None if args.medusa_choices == "mc_sim_7b_63" else choices_for(heads.num_heads,
                                                                                      DEFAULT_MEDUSA_CHOICES)
            acceptance = evaluate_medusa(model, heads, heldout, tokenizer, args.eval_max_tokens, choices, **common)
            tree = f"the {acceptance.draft_tokens + 1}-token tree"
        else:
            drafter = load_eagle(out, model, "eagle3")
            acceptance = evaluate_eagle3(model, drafter, heldout, tokenizer, args.eval_max_tokens, depth=args.depth,
                                         top_k=args.draft_top_k, total_tokens=args.total_tokens, **common)
            tree = f"depth {args.depth}, top-k {args.draft_top_k}, {args.total_tokens}-token trees"
        (out / "acceptance.json").write_text(json.dumps({"model": name, "method": args.method,
                                                         "heldout": args.heldout, **acceptance.as_json()},
                                                        indent=1) + "\n")
        report["acceptance"] = {k: v for k, v in acceptance.as_json().items() if k != "prompts"}
        print(f"held-out: {acceptance.tokens_per_step:.2f} tokens a step with {tree} on {len(heldout)} prompts; "
              f"equal to greedy: {acceptance.equal_to_greedy}; {acceptance.speedup:.2f}x plain greedy's speed",
              file=sys.stderr)
    report["wall_seconds"] = round(time.perf_counter() - began, 1)
    (out / "train.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: report[k] for k in ("steps", "first_loss", "last_loss", "train_seconds", "wall_seconds")}
                     | ({"tokens_per_step": report["acceptance"]["tokens_per_step"],
                         "equal_to_greedy": report["acceptance"]["equal_to_greedy"]} if heldout else {})))
    return 0 if not heldout or report["acceptance"]["equal_to_greedy"] else 1


# ================================================================ private


def _lines(path: Path) -> int:
    return sum(1 for line in path.read_text().splitlines() if line.strip()) if path.is_file() else 0


def _out_dir(text: str) -> str:
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a file; --out is a folder")
    parent = path.resolve().parent
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"the folder {str(parent)!r} (--out's parent) does not exist")
    return text


def _choices_name(text: str) -> str:
    if text not in ("mc_sim_7b_63", "default"):
        raise argparse.ArgumentTypeError(f"must be mc_sim_7b_63 or default, got {text!r}")
    return text


def _plot_losses(losses: list[float], file: Path, name: str, method: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(losses) + 1), losses, lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (sum of heads, 0.8^k weighted)" if method == "medusa" else
                  "KL to the target (sum of TTT steps, 0.8^j weighted)")
    ax.set_title(f"{'Medusa heads' if method == 'medusa' else 'EAGLE-3 drafter'} for {name}")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(file, dpi=100)
    plt.close(fig)
