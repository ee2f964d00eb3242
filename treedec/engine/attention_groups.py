"""The attention of a model's layers in an engine: one plan per layer group a step, one kernel per variant.

A model declares what each layer's attention computes (``model.attention_variants()``, one
:class:`~treedec.attention.AttentionVariant` a layer: Gemma 3's local layers a window, its global ones
none; Gemma 2's soft-cap). Layers whose variants share the mask fields (:meth:`AttentionVariant.mask_key`:
the window) share a *group*, whose plan is made once a step; each distinct variant has its
:class:`~treedec.attention.TreeAttention`, whose backend runs the kernel of its logit fields over its
group's plan (a soft-cap changes the kernel, not the plan). A model of one variant (Llama, Qwen2, Mistral)
has one group and one TreeAttention: a step plans once, as it always did.

:class:`StepAttend` is a step's ``attend(layer, q, k, v)``: it stores the layer's K/V and runs the layer's
TreeAttention over its group's plan, eagerly or as the custom ops (inside CUDA graphs).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from treedec.attention import AttentionVariant, DeviceTreePlan, PlanConfig, TreeAttention, TreePlan
from treedec.attention.dynamic_span import DynamicSpans, located

__all__ = ["LayerAttention", "StepAttend"]


@dataclass(frozen=True)
class LayerAttention:
    """The TreeAttentions of a model's layers, grouped (see the module docstring).

    Attributes
    ----------
    planners : tuple[TreeAttention, ...]
        One per group, in the order of the groups' first layers: the TreeAttention that plans (and prepares)
        the group's plan each step. ``planners[0]`` is layer 0's.
    layer_attn : tuple[TreeAttention, ...]
        Each layer's: the one of its variant.
    layer_group : tuple[int, ...]
        Each layer's group (an index into :attr:`planners` and into a step's plans).
    group_layers : tuple[int, ...]
        How many layers each group has.
    """

    planners: tuple[TreeAttention, ...]
    layer_attn: tuple[TreeAttention, ...]
    layer_group: tuple[int, ...]
    group_layers: tuple[int, ...]

    def __post_init__(self):
        # (what plan_host asks every step: the groups' windows are fixed)
        object.__setattr__(self, "_windowed", any(attn.variant.window is not None for attn in self.planners))

    @classmethod
    def build(cls, variants: tuple[AttentionVariant, ...], num_layers: int, num_qo_heads: int, num_kv_heads: int,
              head_dim: int, backend: str, plan_config: PlanConfig, device: torch.device, dtype: torch.dtype,
              kv_dtype: str | None = None) -> "LayerAttention":
        """One TreeAttention per distinct variant of ``variants`` (one for each of ``num_layers`` layers; the rest as
        :class:`TreeAttention` takes them), grouped by their mask fields; ``kv_dtype`` (None, ``"fp8_e4m3"``: the
        pool's) is every variant's :attr:`~AttentionVariant.kv_dtype`."""
        variants = tuple(variants)
        if len(variants) != num_layers or not all(isinstance(v, AttentionVariant) for v in variants):
            raise TypeError(f"the model's attention_variants() must be one AttentionVariant for each of its "
                            f"{num_layers} layers, got {len(variants)}: {[type(v).__name__ for v in variants][:4]}")
        variants = tuple(dataclasses.replace(v, kv_dtype=kv_dtype) for v in variants)
        attns: dict[AttentionVariant, TreeAttention] = {}
        groups: dict[tuple, int] = {}
        planners, layer_group = [], []
        for variant in variants:
            if variant not in attns:
                attns[variant] = TreeAttention(num_qo_heads, num_kv_heads, head_dim, backend=backend,
                                               plan_config=plan_config, variant=variant, device=device, dtype=dtype)
            key = variant.mask_key()
            if key not in groups:
                groups[key] = len(planners)
                planners.append(attns[variant])
            layer_group.append(groups[key])
        counts = tuple(layer_group.count(g) for g in range(len(planners)))
        return cls(tuple(planners), tuple(attns[v] for v in variants), tuple(layer_group), counts)

    @property
    def windowed(self) -> bool:
        """Whether some group's plan clips the reads to a window."""
        return self._windowed

    @property
    def release_window(self) -> int | None:
        """The widest window when every group's plan clips the reads to one: a key past it is read by no layer,
        and its page may go back to the pool (with a page's margin: the engine's step). None when a group has no
        window (Gemma 3's global layers read every key of the pool the layers share: every page stays)."""
        windows = [attn.variant.window for attn in self.planners]
        return None if None in windows else max(windows)

    def plan_host(self, layout, spans: DynamicSpans | None = None) -> tuple[tuple[TreePlan, ...], list]:
        """The step's host plans, one a group (:meth:`TreeAttention.plan_host`), with the dynamic ``spans``
        located in each (:func:`~treedec.attention.dynamic_span.located`); and each plan's span starts (None
        without spans).

        Raises NotImplementedError, before anything changes, for spans in a step of a windowed group: a span's
        unused slots move the later queries' positions, and so their windows' first keys, on the device."""
        if spans is not None and self._windowed:
            raise NotImplementedError("a dynamic span (pipelined speculative decoding) in a model with sliding-window "
                                      "layers: the window's first key would move with the span's accepted length, "
                                      "which only the device knows; run the speculative loop unpipelined")
        if len(self.planners) == 1:   # (one model variant: the step's one plan, as before groups)
            attn = self.planners[0]
            plan, ranges = located(attn.plan_host(layout), spans, attn.backend_impl)
            return (plan,), [ranges]
        planned = [located(attn.plan_host(layout), spans, attn.backend_impl) for attn in self.planners]
        return tuple(plan for plan, _ in planned), [ranges for _, ranges in planned]

    def prepare(self, plans: tuple[TreePlan, ...], device: torch.device) -> tuple[DeviceTreePlan, ...]:
        """Each host plan copied to ``device`` and prepared by its group's planner (an eager step's launch)."""
        return tuple(attn.prepare(plan.to(device)) for attn, plan in zip(self.planners, plans))

    def kv_tokens_read(self, plans: tuple[TreePlan, ...]) -> int:
        """KV tokens one layer reads per KV head (:meth:`TreePlan.kv_tokens_read`), averaged over the layers."""
        if len(plans) == 1:
            return plans[0].kv_tokens_read()
        total = sum(plan.kv_tokens_read() * count for plan, count in zip(plans, self.group_layers))
        return round(total / len(self.layer_group))


class StepAttend:
    """The :class:`~treedec.models.llama.Attend` of one step: store a layer's K/V at ``slots``, run the layer's
    TreeAttention over its group's plan of ``plans`` (with ``ops``, both as the custom ops of
    :mod:`treedec.attention.custom_ops`)."""

    def __init__(self, layers: LayerAttention, pool, slots: torch.Tensor, plans: tuple[DeviceTreePlan, ...],
                 ops: bool = False):
        self.attn, self.group, self.pool, self.slots, self.plans, self.ops = (
            layers.layer_attn, layers.layer_group, pool, slots, plans, ops)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        pool = self.pool
        k_cache, v_cache = pool.layer(layer)
        plan = self.plans[self.group[layer]]
        scale = pool.layer_scale(layer)   # an fp8 pool's (None: K/V stored as they come)
        if self.ops:
            torch.ops.treedec.store_kv(pool.k_slots[layer], pool.v_slots[layer], self.slots, k, v, scale)
            return self.attn[layer].run_op(q, k_cache, v_cache, plan, scale)
        pool.store(layer, self.slots, k, v)
        return self.attn[layer].run(q, k_cache, v_cache, plan, kv_scale=scale)
