"""Pipeline parallelism for HF causal LMs: split into stages, run torch pipeline schedules, save as HF.

- ``plan_stages`` (pure): decoder layers -> ``pp_size x virtual_stages`` stages, balanced or at split points.
- ``CausalLMStage``: one stage as a view of the HF model, running the model's own forward (HF names kept).
- ``PipelineConfig`` / ``SCHEDULES``: gpipe, 1f1b, interleaved_1f1b, interleaved_zb, zbv.
- ``PipelinedCausalLM``: this rank's stages + schedule + dp gradient reduction; ``train_step``/``eval_step``.
- ``save_pretrained``: one HF directory (or one PEFT adapter) from all stages.

- ``PipelineModel``: this rank's stages as one module with HF parameter names (what DistTrainer holds).

Not for: the Trainer glue (``hf_dist.trainer``).
"""

from hf_dist.pipeline_parallel.save import gather_state_dict, save_pretrained
from hf_dist.pipeline_parallel.model import PipelineModel
from hf_dist.pipeline_parallel.pipeline import PipelinedCausalLM
from hf_dist.pipeline_parallel.schedules import (
    SCHEDULES,
    PipelineConfig,
    check_microbatches,
    theoretical_utilisation,
)
from hf_dist.pipeline_parallel.splitter import StagePlan, plan_stages
from hf_dist.pipeline_parallel.stage_module import CausalLMStage, stage_units
from hf_dist.pipeline_parallel.token_loss import TokenWeightedLoss

__all__ = [
    "SCHEDULES",
    "CausalLMStage",
    "PipelineConfig",
    "PipelineModel",
    "PipelinedCausalLM",
    "StagePlan",
    "TokenWeightedLoss",
    "check_microbatches",
    "gather_state_dict",
    "plan_stages",
    "save_pretrained",
    "stage_units",
    "theoretical_utilisation",
]
