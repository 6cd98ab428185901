"""Capacity planning (how much KV cache a rank holds) and plan-versus-observed comparison."""

from memwatch.plan.capacity import CapacityPlan, LoadRow, PlanError, PlanInputs, plan_capacity

__all__ = ["CapacityPlan", "LoadRow", "PlanError", "PlanInputs", "plan_capacity"]
