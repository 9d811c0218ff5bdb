"""The memory planner: model shapes, bytes per rank of every strategy and device mesh, the `auto` choice, report."""

from scaletune.plan.activations import activation_bytes
from scaletune.plan.choice import choose_auto, choose_checkpointing
from scaletune.plan.entry import GiB, StrategyPlan
from scaletune.plan.estimates import ORDER, Plan, deepspeed_available, plan, plan_name
from scaletune.plan.mesh import MeshCandidate, MeshChoice, mesh_entry, recommend_for_run, recommend_mesh
from scaletune.plan.report import describe_shape, mesh_arithmetic, mesh_notes, render_mesh, render_table, target_env
from scaletune.plan.shapes import ModelShape, ParamInfo, meta_model, model_shape
from scaletune.plan.simulate import simulate_fsdp

__all__ = [
    "GiB",
    "ORDER",
    "MeshCandidate",
    "MeshChoice",
    "ModelShape",
    "ParamInfo",
    "Plan",
    "StrategyPlan",
    "activation_bytes",
    "choose_auto",
    "choose_checkpointing",
    "deepspeed_available",
    "describe_shape",
    "mesh_arithmetic",
    "mesh_entry",
    "mesh_notes",
    "meta_model",
    "model_shape",
    "plan",
    "plan_name",
    "recommend_for_run",
    "recommend_mesh",
    "render_mesh",
    "render_table",
    "simulate_fsdp",
    "target_env",
]
