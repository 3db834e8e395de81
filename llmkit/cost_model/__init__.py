"""What one engine step costs on a modelled device: the model's shape, the device's profile and
the roofline with per-step overheads (``step_cost.CostModel``).

It sits below the scheduler: the simulator (``llmkit sim``, ``llmkit plan``) prices the steps
it replays with it, and ``scheduler=slo`` predicts the next step's time with the same model, so
a plan that chooses the SLO scheduler simulates the decisions the server will make.
"""
from llmkit.cost_model.hardware import HardwareProfile
from llmkit.cost_model.model_shape import ModelShape, ShapeError
from llmkit.cost_model.step_cost import CostModel, SeqWork, StepCost

__all__ = ["CostModel", "HardwareProfile", "ModelShape", "SeqWork", "ShapeError", "StepCost"]
