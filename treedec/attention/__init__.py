"""Tree attention: planners (TreeLayout -> TreePlan), backends (a protocol and a registry), the LSE merge, the
custom ops."""
from treedec.attention.backends import Backend, SpanMasking, backend_names, get_backend, register_backend
from treedec.attention.custom_ops import store_kv, tree_attention as tree_attention_op  # registers torch.ops.treedec.*
from treedec.attention.merge import merge_states
from treedec.attention.planners import PLANNERS, PlanConfig, make_plan, plan_flatten, plan_node, plan_node_chunk
from treedec.attention.persistent_schedule import PersistentSchedule, schedule_units
from treedec.attention.planner_choice import PlannerImpl, planner_impl
from treedec.attention.reference import dense_tree_mask, reference_tree_attention
from treedec.attention.static_plan import PlanBounds, StaticPlan
from treedec.attention.tree_attention import TreeAttention
from treedec.attention.tree_plan import DeviceTreePlan, TreePlan
from treedec.attention.variant import AttentionVariant

__all__ = ["PLANNERS", "AttentionVariant", "Backend", "DeviceTreePlan", "PersistentSchedule", "PlanBounds", "PlanConfig", "PlannerImpl",
           "SpanMasking", "StaticPlan", "TreeAttention", "TreePlan", "backend_names", "dense_tree_mask", "get_backend",
           "make_plan", "merge_states", "plan_flatten", "plan_node", "plan_node_chunk", "planner_impl",
           "reference_tree_attention", "register_backend", "schedule_units", "store_kv", "tree_attention_op"]
