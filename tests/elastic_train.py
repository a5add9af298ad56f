"""The Harbor recipe (examples/harbor/train.py), run unchanged, recording which samples each rank trained on.

``tests/test_elastic.py`` launches this instead of the recipe (elastic.sh's ``TRAIN_SCRIPT``) so that an elastic
run can be checked on sample ids, not only on losses. The train dataset gets a ``sample_id`` column (the row's
index, which is what the sampler hands out; ``--remove_unused_columns false`` keeps it), the collator carries it
through as a tensor, and the trainer takes it out of each micro-batch just before the forward: what is recorded is
what was trained, not what the data loader prefetched. At the end of every optimizer step each rank appends one
line to ``OUTPUT_DIR/sample_ids.jsonl``:

    {"attempt": "...", "start": 4, "world": 2, "rank": 0, "step": 5, "num_samples": 96, "micro": [[..], [..]]}

``attempt`` is the same on every rank of one start of the world (rank 0's token, broadcast) and new at each
restart; ``start`` is the step it resumed from; ``micro`` the ids of each micro-batch of that step, in order.

Not for anything but tests: it patches the recipe's ``DistTrainer`` name.
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import TrainerCallback

from dist_utils import load_recipe  # tests/ is this script's folder, first on sys.path
from hf_dist import DistTrainer

ID = "sample_id"
RECORD = "sample_ids.jsonl"


def _with_ids(collate):
    def collate_with_ids(features: list[dict]):
        ids = [f.pop(ID) for f in features]
        batch = collate(features)
        batch[ID] = torch.tensor(ids, dtype=torch.long)
        return batch

    return collate_with_ids


class _Recorder(TrainerCallback):
    def __init__(self, trainer: "RecordingTrainer"):
        self.trainer = trainer
        self.attempt, self.start = "", 0

    def on_train_begin(self, args, state, control, **kwargs):
        token = [uuid.uuid4().hex]
        if dist.is_initialized():
            dist.broadcast_object_list(token, src=0)
        self.attempt, self.start = token[0], state.global_step  # after the resume: the checkpoint's step
        self.trainer.micro_ids.clear()

    def on_step_end(self, args, state, control, **kwargs):
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        line = {"attempt": self.attempt, "start": self.start, "world": world, "rank": rank, "step": state.global_step,
                "num_samples": len(self.trainer.train_dataset), "micro": self.trainer.micro_ids}
        with open(Path(args.output_dir) / RECORD, "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")  # one write per line: ranks append to the same file
        self.trainer.micro_ids = []
        # a test that signals a run mid-way gives itself time: the tiny run's 8 steps take under a second, and a
        # signal sent after step 2 could otherwise land once the run had finished
        time.sleep(float(os.environ.get("HF_DIST_TEST_STEP_PAUSE", "0")))


class RecordingTrainer(DistTrainer):
    def __init__(self, *args, train_dataset=None, data_collator=None, **kwargs):
        train_dataset = train_dataset.add_column(ID, list(range(len(train_dataset))))
        super().__init__(*args, train_dataset=train_dataset, data_collator=_with_ids(data_collator), **kwargs)
        self.micro_ids: list[list[int]] = []
        self.add_callback(_Recorder(self))

    def training_step(self, model, inputs, num_items_in_batch=None):
        self.micro_ids.append(inputs.pop(ID).tolist())
        return super().training_step(model, inputs, num_items_in_batch)


def main(argv: list[str]) -> int:
    recipe = load_recipe()
    recipe.DistTrainer = RecordingTrainer
    return recipe.main([*argv, "--remove_unused_columns", "false"])


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main(sys.argv[1:]))
