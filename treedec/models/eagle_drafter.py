"""EAGLE drafters (Li et al. 2024, 2025): one decoder layer that drafts from the target's own hidden states.

An EAGLE drafter's query at position ``t`` pairs a *feature* ``f_t`` (a hidden state at token
``t``) with the embedding of the next token ``x_{t+1}``; its output is a feature for ``t + 1``,
whose logits propose ``x_{t+2}``, and which is the feature of the next query when the drafter
runs ahead of the target (drafting is autoregressive at the feature level).

- **EAGLE-1/2** (``kind="eagle"``): ``f`` is the target's final-norm hidden state (the input of
  its ``lm_head``); ``fc(cat(embed(x), f))`` then one decoder layer without an input norm; the
  logits are the *target's* ``lm_head`` of the layer's output. EAGLE-2 differs in how the tree
  is built only (:class:`~treedec.programs.speculative.eagle.EagleDraft`).
- **EAGLE-3** (``kind="eagle3"``): ``f`` fuses the residual stream entering three target layers
  (low, middle, high; default ``(2, L // 2, L - 3)``) by ``fc: 3 * hidden -> hidden``
  (:meth:`EagleDrafter.fuse`); the layer normalises the embedding and the feature separately
  and attends over their concatenation (q/k/v read ``2 * hidden``); the drafter has its own
  final norm and ``lm_head`` over a *draft vocabulary* mapped to the target's by ``d2t``
  (target id = draft id + ``d2t[draft id]``).

The drafter runs on an :class:`~treedec.engine.Engine` of its own (its K/V in pages, its draft
trees in tree attention, its steps in CUDA graphs): :attr:`EagleDrafter.feature_size` tells the
engine that each query also takes a feature row (:meth:`Engine.step`'s ``features``).

Checkpoints, as the EAGLE reference code saves them (a folder with ``config.json``, a
transformers ``LlamaConfig`` of one layer, and ``pytorch_model.bin`` or ``model.safetensors``):

- EAGLE-1/2: ``fc.weight`` [H, 2H], ``fc.bias`` [H] (unless ``"bias": false``),
  ``layers.0.self_attn.{q,k,v,o}_proj.weight``, ``layers.0.mlp.{gate,up,down}_proj.weight``,
  ``layers.0.post_attention_layernorm.weight``, optionally ``embed_tokens.weight``.
- EAGLE-3: ``fc.weight`` [H, 3 * target hidden], ``midlayer.{input_layernorm, hidden_norm,
  post_attention_layernorm}.weight``, ``midlayer.self_attn.{q,k,v}_proj.weight`` [*, 2H],
  ``midlayer.self_attn.o_proj.weight``, ``midlayer.mlp.*``, ``norm.weight``, ``lm_head.weight``
  [draft vocab, H], ``d2t`` [draft vocab] int64, ``t2d`` [vocab] bool, optionally
  ``embed_tokens.weight`` (``layers.0.`` is read as ``midlayer.``); ``config.json`` has
  ``draft_vocab_size`` and may name the layers in ``eagle_config.eagle_aux_hidden_state_layer_ids``
  (layer *outputs*, as the reference counts them: output of layer ``i`` = input of ``i + 1``).

:func:`load_eagle` reads both (checked tensor by tensor against the target); :func:`save_eagle`
writes them; :meth:`EagleDrafter.random` makes random drafters (tests, benchmarks).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from torch import nn

from treedec.attention.variant import AttentionVariant
from treedec.models.base import Attend, DecoderModel, ForwardOutput
from treedec.models.config import ModelConfig
from treedec.models.eagle_config import default_aux_layers, read_eagle_config
from treedec.models.layers import PointwiseOps, RMSNorm
from treedec.models.linear import Linear
from treedec.errors import CheckpointError
from treedec.models.hf_tensors import init_random_
from treedec.models.loading import SUPPORTED_DTYPES, read_json_object, read_state_dict
from treedec.models.rope import rope_cos_sin, rope_inv_freq

KINDS = ("eagle", "eagle3")
CHECKPOINT_NAMES = ("model.safetensors", "pytorch_model.bin")


class EagleLayer(nn.Module):
    """The drafter's decoder layer (fused q/k/v and gate/up projections, as
    :class:`~treedec.models.llama.DecoderLayer`).

    EAGLE-1: attention reads the feature as it is (no input norm). EAGLE-3: it reads
    ``cat(input_norm(embedding), hidden_norm(feature))``, ``2 * hidden`` wide.
    """

    def __init__(self, config: ModelConfig, eagle3: bool, dtype: torch.dtype | None = None, device=None):
        super().__init__()
        c = config
        self.eagle3 = eagle3
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        width = 2 * c.hidden_size if eagle3 else c.hidden_size
        kw = {"dtype": dtype, "device": device}
        if eagle3:
            self.input_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
            self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.qkv_proj = Linear(width, c.qkv_size, c.qkv_bias, **kw, shards=(c.num_heads * c.head_dim,
                                                                             c.num_kv_heads * c.head_dim,
                                                                             c.num_kv_heads * c.head_dim))
        self.o_proj = Linear(c.num_heads * c.head_dim, c.hidden_size, c.o_bias, **kw)
        self.post_attention_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.gate_up_proj = Linear(c.hidden_size, 2 * c.intermediate_size, c.mlp_bias, **kw,
                                   shards=(c.intermediate_size, c.intermediate_size))
        self.down_proj = Linear(c.intermediate_size, c.hidden_size, c.mlp_bias, **kw)

    def forward(self, x: torch.Tensor, emb: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend,
                ops: PointwiseOps) -> torch.Tensor:
        """``x`` [n, hidden] the feature (the residual stream), ``emb`` [n, hidden] the tokens' embeddings."""
        n, hq, hkv = x.shape[0], self.num_heads, self.num_kv_heads
        if self.eagle3:
            h = torch.cat([ops.rms_norm(emb, self.input_norm.weight, self.input_norm.eps),
                           ops.rms_norm(x, self.hidden_norm.weight, self.hidden_norm.eps)], dim=-1)
        else:
            h = x
        qkv = self.qkv_proj(h).view(n, hq + 2 * hkv, self.head_dim)
        qk = ops.rope(qkv[:, :hq + hkv], cos, sin)
        out = attend(0, qk[:, :hq], qk[:, hq:], qkv[:, hq + hkv:])
        x, h = ops.add_rms_norm(x, self.o_proj(out.reshape(n, hq * self.head_dim)),
                                self.post_attention_norm.weight, self.post_attention_norm.eps)
        return x + self.down_proj(ops.gated(self.gate_up_proj(h), "silu"))


class EagleDrafter(nn.Module):
    """An EAGLE-1/2 or EAGLE-3 draft network for a target model (a :class:`~treedec.models.DecoderModel`).

    Build it with :func:`load_eagle` or :meth:`random`; run it on its own :class:`~treedec.engine.Engine`
    (:class:`~treedec.programs.speculative.eagle.EagleDraft` does). ``config`` is a one-layer
    :class:`~treedec.models.ModelConfig` whose ``vocab_size`` is the target's (the token ids it
    embeds); its logits are over :attr:`draft_vocab_size` tokens (the target's vocabulary for
    EAGLE-1, see :meth:`to_target_ids`).

    Attributes
    ----------
    kind : "eagle" or "eagle3".
    aux_layers : EAGLE-3: the target layers whose inputs :meth:`fuse` reads, ascending (the engine
        captures them: :meth:`Engine.capture_hidden_layers`); () for EAGLE-1.
    kv_scales : None (EAGLE releases hold no fp8 KV-cache scales: an fp8 pool of a drafter's has scales 1.0).
    """

    kv_scales = None

    def __init__(self, config: ModelConfig, kind: str, target: DecoderModel, draft_vocab_size: int | None = None,
                 aux_layers: tuple[int, ...] = (), fc_bias: bool = True, own_embedding: bool = False,
                 dtype: torch.dtype | None = None, device=None):
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        if config.num_layers != 1:
            raise NotImplementedError(f"EAGLE drafters of {config.num_layers} layers are not supported (one layer, "
                                      f"as the EAGLE releases)")
        super().__init__()
        eagle3 = kind == "eagle3"
        t = target.config
        if config.vocab_size != t.vocab_size:
            raise ValueError(f"the drafter embeds a {config.vocab_size}-token vocabulary, the target has "
                             f"{t.vocab_size} tokens")
        if not eagle3 and config.hidden_size != t.hidden_size:
            raise ValueError(f"an EAGLE-1 drafter's hidden size ({config.hidden_size}) must be the target's "
                             f"({t.hidden_size}): it reads the target's hidden states and lm_head")
        self.config, self.kind = config, kind
        self.eos_token_ids = target.eos_token_ids
        self.draft_vocab_size = t.vocab_size if draft_vocab_size is None else int(draft_vocab_size)
        if not eagle3 and self.draft_vocab_size != t.vocab_size:
            raise ValueError("an EAGLE-1 drafter drafts over the target's vocabulary (no draft_vocab_size)")
        self.aux_layers = tuple(sorted(target.check_aux_layers(aux_layers))) if eagle3 else ()
        if eagle3 and len(self.aux_layers) != 3:
            raise ValueError(f"an EAGLE-3 drafter fuses 3 target layers, got {list(aux_layers)}")
        kw = {"dtype": dtype, "device": device}
        H = config.hidden_size
        if t.hidden_size != H and not own_embedding:
            raise ValueError(f"a drafter of hidden size {H} for a target of hidden size {t.hidden_size} needs its "
                             f"own embed_tokens (the target's rows are {t.hidden_size} wide)")
        self.target_hidden_size = t.hidden_size
        fc_in = 3 * t.hidden_size if eagle3 else 2 * H
        self.fc = Linear(fc_in, H, fc_bias and not eagle3, **kw)
        self.layer = EagleLayer(config, eagle3, dtype, device)
        if own_embedding:
            self.embed_tokens = nn.Embedding(config.vocab_size, H, **kw)
        else:
            self.embed_tokens = target.embed_tokens          # the target's table, shared
        if eagle3:
            self.norm = RMSNorm(H, config.rms_norm_eps, dtype)
            self.lm_head = Linear(H, self.draft_vocab_size, False, **kw)
            self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.int64, device=device))
        else:
            self.lm_head = target.lm_head                    # EAGLE-1 drafts through the target's head
        self.register_buffer("inv_freq", rope_inv_freq(config, device=device or "cpu"), persistent=False)
        self.ops = PointwiseOps()

    # ---------------------------------------------------------------- properties

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    @property
    def feature_size(self) -> int:
        """Width of the feature each query reads (:meth:`~treedec.engine.Engine.step`'s ``features``)."""
        return self.config.hidden_size

    @property
    def tensor_parallel(self) -> None:
        """None: a drafter runs whole on each rank's engine."""
        return None

    def attention_variants(self) -> tuple[AttentionVariant, ...]:
        """The drafter's one layer attends as a Llama layer does (the head dim's scale, no cap, no window)."""
        return (AttentionVariant(),)

    def check_aux_layers(self, layers) -> tuple[int, ...]:
        """A drafter has no inner layers to return: ``layers`` must be empty."""
        out = tuple(layers)
        if out:
            raise ValueError(f"an EAGLE drafter has no inner layers to return, got {list(out)}")
        return out

    def weight_bytes(self) -> int:
        """Bytes one drafter step streams: every parameter but the embedding table (a step reads only
        its tokens' rows), the shared ``lm_head`` included."""
        emb = self.embed_tokens.weight
        return sum(p.numel() * p.element_size() for p in {id(p): p for p in self.parameters()}.values()
                   if p is not emb)

    # ---------------------------------------------------------------- the network

    def fuse(self, target_states: torch.Tensor) -> torch.Tensor:
        """The target's hidden states -> drafter features ``[n, hidden]``.

        EAGLE-1: ``target_states`` [n, hidden], the target's final-norm states, as they are.
        EAGLE-3: [n, 3, target hidden], the inputs of :attr:`aux_layers` (``Engine.step``'s ``aux``
        restricted to them), fused by ``fc``.
        """
        if self.kind == "eagle":
            return target_states
        with torch.no_grad():
            return self.fc(target_states.reshape(target_states.shape[0], -1).to(self.dtype))

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids -> the target's token ids (``id + d2t[id]``; the same ids for EAGLE-1)."""
        return draft_ids + self.d2t[draft_ids] if self.kind == "eagle3" else draft_ids

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, attend: Attend,
                logits_rows: torch.Tensor | None = None, aux_layers: tuple[int, ...] = (),
                features: torch.Tensor | None = None) -> ForwardOutput:
        """One drafter step (the signature of :meth:`DecoderModel.forward <treedec.models.base.DecoderModel.forward>`).

        ``tokens`` [n] the tokens after the features' positions, ``positions`` [n] the features'
        positions, ``features`` [n, hidden] (:meth:`fuse`'d target states, or the drafter's own
        outputs when it runs ahead). Returns logits ``[r, draft_vocab_size]`` at ``logits_rows``
        and ``hidden`` [n, hidden]: each row's output feature (before the final norm).
        """
        return self.forward_graph(tokens, positions, attend, logits_rows, aux_layers, features)

    def forward_graph(self, tokens: torch.Tensor, positions: torch.Tensor, attend: Attend,
                      logits_rows: torch.Tensor | None = None, aux_layers: tuple[int, ...] = (),
                      features: torch.Tensor | None = None) -> ForwardOutput:
        """:meth:`forward` without its inference mode (for ``torch.compile``)."""
        if features is None:
            raise ValueError("an EAGLE drafter step needs features (one row per query)")
        if aux_layers:
            raise ValueError("an EAGLE drafter has no inner layers to return")
        cos, sin = rope_cos_sin(self.inv_freq, positions, self.dtype)
        emb = self.embed_tokens(tokens).to(self.dtype)
        x = features if self.kind == "eagle3" else self.fc(torch.cat([emb, features], dim=-1))
        x = self.layer(x, emb, cos, sin, attend, self.ops)
        y = x if logits_rows is None else x[logits_rows]
        if self.kind == "eagle3":
            y = self.ops.rms_norm(y, self.norm.weight, self.norm.eps)
        return ForwardOutput(self.lm_head(y), x, None)

    # ---------------------------------------------------------------- builders

    @classmethod
    def random(cls, target: DecoderModel, kind: str = "eagle", seed: int = 0, draft_vocab_size: int | None = None,
               std: float = 0.02) -> "EagleDrafter":
        """A drafter with random weights for ``target`` (its shape, dtype and device): linear weights
        ~ N(0, std), norms 1, biases 0. EAGLE-3: the default layers, and a draft vocabulary of
        ``draft_vocab_size`` target tokens (default: all) drawn at random, in id order."""
        t = target.config
        config = dataclasses.replace(t, num_layers=1)
        layers = default_aux_layers(t.num_layers) if kind == "eagle3" else ()
        vocab = draft_vocab_size if kind == "eagle3" else None
        # (the norms' weights are made on the CPU; the target's shared modules are on its device already)
        drafter = cls(config, kind, target, vocab, layers, dtype=target.dtype, device=target.device).to(target.device)
        gen = torch.Generator(device=target.device).manual_seed(seed)
        with torch.no_grad():
            for name, p in drafter.named_parameters():
                if not (name.startswith("embed_tokens") or (kind == "eagle" and name.startswith("lm_head"))):
                    init_random_(name, p, std, gen)   # (else the target's)
            if kind == "eagle3":
                ids = torch.randperm(t.vocab_size, generator=gen, device=target.device)[:drafter.draft_vocab_size]
                ids = ids.sort().values
                drafter.d2t.copy_(ids - torch.arange(len(ids), device=target.device))
        return drafter


# ================================================================ checkpoints


def load_eagle(path: str | Path, target: DecoderModel, kind: str | None = None) -> EagleDrafter:
    """Load an EAGLE reference checkpoint folder for ``target`` (its dtype and device).

    ``kind``: "eagle" or "eagle3", checked against the checkpoint; None: read from it (EAGLE-3
    checkpoints have ``d2t`` / ``midlayer.*``). The config's fields (as :func:`from_pretrained
    <treedec.models.from_pretrained>` checks them, and ``draft_vocab_size``, ``bias``, the aux
    layer ids), every tensor's dtype and shape, and the ``d2t`` / ``t2d`` draft vocabulary map
    (integer / bool, each draft id to its own target id) are checked: CheckpointError names the
    file, the key or tensor, the expected and the actual value; FileNotFoundError a missing file.
    """
    if kind not in (None, *KINDS):
        raise ValueError(f"kind must be one of {KINDS} or None, got {kind!r}")
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"EAGLE checkpoint folder {str(root)!r} does not exist")
    config_file = root / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{root} has no config.json (an EAGLE checkpoint is a folder with config.json and "
                                f"{' or '.join(CHECKPOINT_NAMES)})")
    file = next((root / n for n in CHECKPOINT_NAMES if (root / n).is_file()), None)
    if file is None:
        raise FileNotFoundError(f"{root} holds no EAGLE weights (looked for {', '.join(CHECKPOINT_NAMES)})")
    raw = read_json_object(config_file)
    state = read_state_dict(file, "EAGLE checkpoint")
    t = target.config
    fc = state.get("fc.weight")
    eagle3 = "d2t" in state or any(k.startswith("midlayer.") for k in state) or \
        (fc is not None and fc.dim() == 2 and fc.shape[1] == 3 * t.hidden_size)
    found = "eagle3" if eagle3 else "eagle"
    if kind is not None and kind != found:
        names = {"eagle": "EAGLE-1/2", "eagle3": "EAGLE-3"}
        raise CheckpointError(f"{root} holds an {names[found]} drafter, not {names[kind]} "
                              f"(tensors {sorted(state)[:4]} ...)")
    if eagle3:   # exports that name the layer as the EAGLE-1 layout does
        state = {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v for k, v in state.items()}
    c = read_eagle_config(raw, config_file, eagle3, t)
    if eagle3 and "d2t" not in state and "t2d" not in state and c.draft_vocab_size == t.vocab_size:
        state["d2t"] = torch.zeros(t.vocab_size, dtype=torch.int64)        # the same vocabulary: no mapping
        state["t2d"] = torch.ones(t.vocab_size, dtype=torch.bool)
    try:   # on the meta device, norms included: nothing of the config's size is allocated before the check
        with torch.device("meta"):
            drafter = EagleDrafter(c.config, found, target, c.draft_vocab_size, c.aux_layers, c.fc_bias,
                                   own_embedding="embed_tokens.weight" in state, dtype=target.dtype, device="meta")
    except ValueError as e:
        raise CheckpointError(f"{config_file}: {e}") from None
    drafter.load_state_dict(_to_treedec(state, drafter, file), strict=False, assign=True)
    drafter.inv_freq = rope_inv_freq(c.config)   # (not in the checkpoint: made on the meta device)
    return drafter.to(target.device)


def save_eagle(drafter: EagleDrafter, path: str | Path, file_name: str | None = None) -> Path:
    """Write ``drafter`` as the EAGLE reference code lays its checkpoints out (see the module docstring):
    ``config.json`` and ``file_name`` (default ``pytorch_model.bin`` for EAGLE-1, ``model.safetensors``
    for EAGLE-3). Returns the folder."""
    from treedec.models.registry import to_hf_config
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    c = drafter.config
    raw = to_hf_config(c).to_dict()
    raw["num_hidden_layers"] = 1
    if drafter.kind == "eagle":
        raw["bias"] = drafter.fc.bias is not None
    else:
        raw["draft_vocab_size"] = drafter.draft_vocab_size
        raw["target_hidden_size"] = drafter.target_hidden_size
        raw["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in drafter.aux_layers]}
    (root / "config.json").write_text(json.dumps(raw, indent=2, default=str), encoding="utf-8")
    state = {k: v.detach().to("cpu").contiguous() for k, v in _to_reference(drafter).items()}
    name = file_name or ("pytorch_model.bin" if drafter.kind == "eagle" else "model.safetensors")
    if name.endswith(".safetensors"):
        from safetensors.torch import save_file
        save_file(state, str(root / name))
    else:
        torch.save(state, root / name)
    return root


# ================================================================ private


def _reference_shapes(d: EagleDrafter) -> dict[str, tuple[int, ...]]:
    c, H = d.config, d.config.hidden_size
    eagle3 = d.kind == "eagle3"
    p = "midlayer." if eagle3 else "layers.0."
    width = 2 * H if eagle3 else H
    shapes = {"fc.weight": (H, 3 * d.target_hidden_size if eagle3 else 2 * H),
              f"{p}self_attn.q_proj.weight": (c.num_heads * c.head_dim, width),
              f"{p}self_attn.k_proj.weight": (c.num_kv_heads * c.head_dim, width),
              f"{p}self_attn.v_proj.weight": (c.num_kv_heads * c.head_dim, width),
              f"{p}self_attn.o_proj.weight": (H, c.num_heads * c.head_dim),
              f"{p}mlp.gate_proj.weight": (c.intermediate_size, H),
              f"{p}mlp.up_proj.weight": (c.intermediate_size, H),
              f"{p}mlp.down_proj.weight": (H, c.intermediate_size),
              f"{p}post_attention_layernorm.weight": (H,)}
    if d.fc.bias is not None:
        shapes["fc.bias"] = (H,)
    if c.qkv_bias:
        shapes.update({f"{p}self_attn.{n}_proj.bias": (shapes[f"{p}self_attn.{n}_proj.weight"][0],)
                       for n in "qkv"})
    if eagle3:
        shapes.update({f"{p}input_layernorm.weight": (H,), f"{p}hidden_norm.weight": (H,), "norm.weight": (H,),
                       "lm_head.weight": (d.draft_vocab_size, H), "d2t": (d.draft_vocab_size,),
                       "t2d": (c.vocab_size,)})
    return shapes


def _to_treedec(state: dict[str, torch.Tensor], d: EagleDrafter, file: Path) -> dict[str, torch.Tensor]:
    """Reference tensors -> this module's parameters (q/k/v and gate/up fused); every shape checked."""
    shapes = _reference_shapes(d)
    optional = {"embed_tokens.weight": (d.config.vocab_size, d.config.hidden_size)}
    missing = sorted(set(shapes) - set(state))
    unknown = sorted(set(state) - set(shapes) - set(optional))
    if missing or unknown:
        raise CheckpointError(f"{file}: an {d.kind} drafter for this target expects other tensors: missing "
                              f"{missing[:6]}, unexpected {unknown[:6]}")
    floats = tuple(SUPPORTED_DTYPES.values())
    for key, shape in {**shapes, **{k: v for k, v in optional.items() if k in state}}.items():
        dtype = state[key].dtype
        if key == "d2t" and (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool):
            raise CheckpointError(f"{file}: 'd2t' has dtype {dtype}, expected an integer dtype (target id - draft id)")
        if key == "t2d" and dtype != torch.bool:
            raise CheckpointError(f"{file}: 't2d' has dtype {dtype}, expected torch.bool (the target ids drafted)")
        if key not in ("d2t", "t2d") and dtype not in floats:
            raise CheckpointError(f"{file}: '{key}' has dtype {dtype}, expected one of "
                                  f"[{', '.join(str(d) for d in floats)}]")
        if tuple(state[key].shape) != shape:
            raise CheckpointError(f"{file}: '{key}' has shape {list(state[key].shape)}, expected {list(shape)} "
                                  f"(drafter hidden size {d.config.hidden_size}, target hidden size "
                                  f"{d.target_hidden_size}, vocabulary {d.config.vocab_size})")
    dt = d.dtype
    p = "midlayer." if d.kind == "eagle3" else "layers.0."
    out = {"fc.weight": state["fc.weight"].to(dt),
           "layer.qkv_proj.weight": torch.cat([state[f"{p}self_attn.{n}_proj.weight"] for n in "qkv"]).to(dt),
           "layer.o_proj.weight": state[f"{p}self_attn.o_proj.weight"].to(dt),
           "layer.gate_up_proj.weight": torch.cat([state[f"{p}mlp.gate_proj.weight"],
                                                   state[f"{p}mlp.up_proj.weight"]]).to(dt),
           "layer.down_proj.weight": state[f"{p}mlp.down_proj.weight"].to(dt),
           "layer.post_attention_norm.weight": state[f"{p}post_attention_layernorm.weight"].to(dt)}
    if "fc.bias" in shapes:
        out["fc.bias"] = state["fc.bias"].to(dt)
    if d.config.qkv_bias:
        out["layer.qkv_proj.bias"] = torch.cat([state[f"{p}self_attn.{n}_proj.bias"] for n in "qkv"]).to(dt)
    if "embed_tokens.weight" in state:
        out["embed_tokens.weight"] = state["embed_tokens.weight"].to(dt)
    if d.kind == "eagle3":
        d2t, t2d = state["d2t"].to(torch.int64), state["t2d"]
        target_ids = d2t + torch.arange(len(d2t))
        in_range = not len(d2t) or (target_ids.min() >= 0 and target_ids.max() < d.config.vocab_size)
        if in_range and len(torch.unique(target_ids)) != len(target_ids):
            ordered = target_ids.sort()
            twice = int((ordered.values[1:] == ordered.values[:-1]).nonzero()[0])
            first, second = sorted(int(i) for i in ordered.indices[twice:twice + 2])
            raise CheckpointError(f"{file}: 'd2t' maps draft ids {first} and {second} both to target id "
                                  f"{int(ordered.values[twice])}: each draft id must draft its own target token")
        if len(d2t) and (not in_range or not bool(t2d[target_ids].all()) or int(t2d.sum()) != len(d2t)):
            raise CheckpointError(f"{file}: 'd2t' and 't2d' disagree: d2t must map each draft id i to a target id "
                                  f"i + d2t[i] < {d.config.vocab_size} that t2d marks, one for each of its "
                                  f"{int(t2d.sum())} marks")
        out.update({"layer.input_norm.weight": state[f"{p}input_layernorm.weight"].to(dt),
                    "layer.hidden_norm.weight": state[f"{p}hidden_norm.weight"].to(dt),
                    "norm.weight": state["norm.weight"].to(dt), "lm_head.weight": state["lm_head.weight"].to(dt),
                    "d2t": d2t})
    return out


def _to_reference(d: EagleDrafter) -> dict[str, torch.Tensor]:
    c = d.config
    p = "midlayer." if d.kind == "eagle3" else "layers.0."
    q, k, v = d.layer.qkv_proj.weight.split([c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim,
                                             c.num_kv_heads * c.head_dim])
    gate, up = d.layer.gate_up_proj.weight.chunk(2)
    out = {"fc.weight": d.fc.weight, f"{p}self_attn.q_proj.weight": q, f"{p}self_attn.k_proj.weight": k,
           f"{p}self_attn.v_proj.weight": v, f"{p}self_attn.o_proj.weight": d.layer.o_proj.weight,
           f"{p}mlp.gate_proj.weight": gate, f"{p}mlp.up_proj.weight": up,
           f"{p}mlp.down_proj.weight": d.layer.down_proj.weight,
           f"{p}post_attention_layernorm.weight": d.layer.post_attention_norm.weight}
    if d.fc.bias is not None:
        out["fc.bias"] = d.fc.bias
    if c.qkv_bias:
        for n, b in zip("qkv", d.layer.qkv_proj.bias.split([c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim,
                                                             c.num_kv_heads * c.head_dim])):
            out[f"{p}self_attn.{n}_proj.bias"] = b
    if d.kind == "eagle3":
        t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
        t2d[d.to_target_ids(torch.arange(d.draft_vocab_size, device=d.d2t.device)).cpu()] = True
        out.update({f"{p}input_layernorm.weight": d.layer.input_norm.weight,
                    f"{p}hidden_norm.weight": d.layer.hidden_norm.weight, "norm.weight": d.norm.weight,
                    "lm_head.weight": d.lm_head.weight, "d2t": d.d2t, "t2d": t2d})
    return out
