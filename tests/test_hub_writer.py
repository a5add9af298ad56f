"""The one Hub writer (``hf_dist.hub_writer``): huggingface_hub's shard plan, the files and the index it writes.

Pure: no process group. The distributed callers (final save, pipeline save, exports) are covered in
``test_streaming_save.py``, ``test_loading.py``, ``test_checkpoint_export.py`` and ``test_export_verify.py``.
"""

from __future__ import annotations

import json

import torch

from hf_dist.hub_writer import INDEX_NAME, plan_shards, write_weights


def _entries(sizes: dict[str, int]) -> dict:
    return {name: ((size,), torch.uint8) for name, size in sizes.items()}


def test_the_plan_keeps_every_file_within_the_limit_and_a_larger_tensor_alone():
    plan = plan_shards(_entries({"a": 4, "b": 4, "c": 9, "d": 1}), 8)
    groups = sorted(sorted(names) for names in plan.filename_to_tensors.values())
    assert groups == [["a", "b"], ["c"], ["d"]]
    assert sorted(plan.filename_to_tensors) == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    single = plan_shards(_entries({"a": 1}), 8)
    assert list(single.filename_to_tensors) == ["model.safetensors"] and not single.is_sharded


def test_written_folder_holds_every_tensor_once_with_an_exact_index(tmp_path):
    from safetensors.torch import load_file

    tensors = {f"w{i}": torch.arange(6 * (i + 1), dtype=torch.float32).reshape(i + 1, 6) for i in range(4)}
    asked: list[list[str]] = []

    def produce(names: list[str]) -> dict[str, torch.Tensor]:
        asked.append(names)
        return {name: tensors[name] for name in names}

    entries = {name: (tuple(t.shape), t.dtype) for name, t in tensors.items()}
    written = write_weights(tmp_path, entries, produce, max_shard_size=100)
    assert sorted(name for names in asked for name in names) == sorted(tensors)  # each tensor asked for once
    assert written.files[-1] == INDEX_NAME and len(written.files) == len(asked) + 1
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    assert index["metadata"]["total_size"] == written.total_bytes == sum(t.nbytes for t in tensors.values())
    assert written.largest_shard_bytes <= max(100, max(t.nbytes for t in tensors.values()))
    for name, tensor in tensors.items():
        torch.testing.assert_close(load_file(tmp_path / index["weight_map"][name])[name], tensor, rtol=0, atol=0)


def test_only_the_main_process_writes_but_every_process_is_asked(tmp_path):
    calls = []
    entries = {"a": ((2,), torch.float32), "b": ((2,), torch.float32)}
    written = write_weights(tmp_path, entries, lambda names: calls.append(names), max_shard_size=8, is_main=False)
    assert calls == [["a"], ["b"]] and written.files == [] and not any(tmp_path.iterdir())


def test_an_adapter_is_one_file_named_as_peft_names_it(tmp_path):
    from safetensors import safe_open

    from hf_dist.hub_writer import ADAPTER_FILES

    entries = {f"layer{i}.lora_A.weight": ((4, 8), torch.float32) for i in range(3)}
    written = write_weights(tmp_path, entries, lambda names: {n: torch.ones(4, 8) for n in names},
                            max_shard_size=None, filename_pattern=ADAPTER_FILES)
    assert written.files == ["adapter_model.safetensors"] == [p.name for p in tmp_path.iterdir()]
    with safe_open(tmp_path / "adapter_model.safetensors", "pt") as f:
        assert sorted(f.keys()) == sorted(entries) and f.metadata() == {"format": "pt"}
