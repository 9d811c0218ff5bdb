"""The memory planner: model shapes, bytes per rank of every strategy, the `auto` choice, report."""

from scaletune.plan.choice import choose_auto
from scaletune.plan.estimates import (
    ORDER,
    GiB,
    Plan,
    StrategyPlan,
    activation_bytes,
    deepspeed_available,
    plan,
    plan_name,
)
from scaletune.plan.report import describe_shape, render_table, target_env
from scaletune.plan.shapes import ModelShape, ParamInfo, meta_model, model_shape
from scaletune.plan.simulate import simulate_fsdp

__all__ = [
    "GiB",
    "ORDER",
    "ModelShape",
    "ParamInfo",
    "Plan",
    "StrategyPlan",
    "activation_bytes",
    "choose_auto",
    "deepspeed_available",
    "describe_shape",
    "meta_model",
    "model_shape",
    "plan",
    "plan_name",
    "render_table",
    "simulate_fsdp",
    "target_env",
]
