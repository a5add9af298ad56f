"""``checkpoint_kind``: the one answer to what wrote a folder, on folders laid out as each writer lays them out."""

from __future__ import annotations

from pathlib import Path

import pytest

from hf_dist.checkpoint.kind import TRAINER_KINDS, checkpoint_kind


def _folder(root: Path, *files: str) -> Path:
    for name in files:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("{}")
    return root


@pytest.mark.parametrize(
    "files, kind",
    [
        (("manifest.json", "trainer_state.json", "hf/config.json"), "hf_dist"),  # DistTrainer's hf_dist checkpoint
        (("trainer_state.json", "config.json", "model.safetensors"), "trainer_native"),  # DDP / one process
        (("trainer_state.json", "adapter_config.json", "adapter_model.safetensors"), "trainer_native"),  # LoRA
        (("trainer_state.json", "config.json", "model.safetensors", "global_step4/mp_rank_00_model_states.pt"),
         "trainer_native"),  # ZeRO-3 with the gathered 16-bit weights
        (("trainer_state.json", "config.json", "global_step4/zero_pp_rank_0_mp_rank_00_model_states.pt"),
         "trainer_zero"),
        (("config.json", "model-00001-of-00002.safetensors", "model.safetensors.index.json"), "model_dir"),
        (("latest", "global_step4/mp_rank_00_model_states.pt"), "zero"),
        (("config.json",), None),
        ((), None),
    ],
)
def test_each_writer_is_told_apart(tmp_path, files, kind):
    assert checkpoint_kind(_folder(tmp_path / "ckpt", *files) if files else tmp_path) == kind


def test_no_folder_is_no_checkpoint(tmp_path):
    assert checkpoint_kind(None) is None
    assert checkpoint_kind(tmp_path / "missing") is None
    assert checkpoint_kind(_folder(tmp_path, "file.json") / "file.json") is None
    assert TRAINER_KINDS == {"trainer_native", "trainer_zero"}
