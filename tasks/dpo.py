"""dpo: an SFT model + preference shards -> a preference-tuned model or LoRA adapter, with TRL's DPOTrainer.

Inputs: one preference `shards` artifact ({prompt, chosen, rejected} records) and one `model` artifact
(the sft stage's model: the policy starts from it and it is the reference), plus optionally a `tokenizer`
artifact (by default the model artifact's own). With lora the reference is the same model with the
adapter disabled; with full it is a frozen copy. Pairs with chosen == rejected are skipped and counted
(`skipped_identical_pairs`); pairs whose prompt alone reaches `max_length_tokens`, which DPOTrainer drops
silently, are counted too (`dropped_prompt_too_long`). Training runs in a child process with checkpoints
in the store (a rerun resumes) and metrics on the stage's MLflow run (`train/loss`, `train/reward_accuracy`,
`train/margin`, `eval/reward_accuracy`, `eval/margin`, ...).

Output: a `model` artifact like sft's: a full model or an adapter on top of the input model artifact, the
tokenizer and `lmforge_model.json` (`trained_with: dpo`); `trainer.models.load_trained` reloads it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from lmforge.port import Port
from lmforge.stage import StageDef, StageRuntime
from lmforge.store import Artifact
from tasks.training import PreferenceResult, TrainingConfig, check_preference_inputs, launch_training
from trainer.settings import DpoSettings


class DpoStageConfig(TrainingConfig, DpoSettings):
    kind: Literal["dpo"] = Field(description="Direct preference optimization of an SFT model (TRL DPOTrainer).")


class DpoResult(PreferenceResult):
    format: str
    reference: str
    dropped_prompt_too_long: int


def run(cfg: DpoStageConfig, inputs: list[Artifact], out: Path, runtime: StageRuntime) -> DpoResult:
    return DpoResult(**launch_training("dpo", cfg, inputs, out, runtime))


def output_port(cfg: DpoStageConfig, inputs: list[Port]) -> Port:
    check_preference_inputs("dpo", inputs)
    if cfg.base_model is not None:
        raise ValueError("dpo starts from the model it is given in inputs (an sft stage); remove base_model")
    if not any(p.type == "model" for p in inputs):
        raise ValueError("dpo needs a model to start from: add an sft stage to inputs")
    return Port("model")


STAGE = StageDef(kind="dpo", version="1", code=("trainer.entry", "trainer.dpo", "trainer.tokens"),  # the child's code
                 config=DpoStageConfig, run=run, output_port=output_port, wants_runtime=True,
                 description="SFT model + preference shards -> DPO-tuned model or LoRA adapter (TRL DPOTrainer)",
                 output_type="model")
