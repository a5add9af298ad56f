"""examples/notebooks/finetune_hub_model.ipynb executed top to bottom with nbclient, as CI runs it: CPU, offline, the
real pretrained SmolLM2-135M-Instruct (hf_dist.models.demo_model_dir).

The notebook asserts on itself (world size seen by each run, perplexity lowered, exports reload with the
distributed perplexity); this test also reads what it wrote. Parameters are overridden papermill-style: a cell
inserted after the one tagged ``parameters``.
"""

import json
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from dist_utils import free_port

NOTEBOOK = Path(__file__).resolve().parents[1] / "examples" / "notebooks" / "finetune_hub_model.ipynb"


def _with_parameters(nb, **values):
    index = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
    source = "\n".join(f"{name} = {value!r}" for name, value in values.items())
    nb.cells.insert(index + 1, nbformat.v4.new_code_cell(source, metadata={"tags": ["injected-parameters"]}))
    return nb


pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def executed(tmp_path_factory, demo_model):  # demo_model: the converted folder exists before the kernel starts
    work = tmp_path_factory.mktemp("notebook")
    nb = _with_parameters(nbformat.read(NOTEBOOK, as_version=4), MASTER_PORT=str(free_port()), OUTPUT_DIR="run")
    NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(work)}}).execute()
    return nb, work / "run"


def test_notebook_trains_full_and_lora_on_two_processes(executed):
    _, run = executed
    results = json.loads((run / "results.json").read_text())
    answers = results.pop("answers")
    assert set(results) == {"full", "lora"}
    assert set(answers) == {"before", "full", "lora"} and all(len(a) == 2 for a in answers.values())
    assert all(text.strip() for a in answers.values() for text in a)  # a pretrained chat model answers
    for mode, r in results.items():
        assert r["num_processes"] == r["world_size"] == 2, (mode, r)
        assert r["layout"] == "DDP (MULTI_CPU)"
        assert len(r["losses"]) == 4
        assert r["perplexity_after"] < r["perplexity_before"]
        assert abs(r["export_perplexity"] / r["perplexity_after"] - 1) < 1e-4


def test_exports_are_hub_ready_directories(executed):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, run = executed
    for mode in ("full", "lora"):
        export = run / "export" / mode
        assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in export.iterdir()}
        assert not (export / "adapter_config.json").exists()  # the LoRA export is merged, loadable without peft
        model = AutoModelForCausalLM.from_pretrained(export)
        assert (model.config.num_hidden_layers, model.config.vocab_size) == (30, 49152)  # the real model
        assert AutoTokenizer.from_pretrained(export).chat_template


def test_every_cell_ran_without_error(executed):
    nb, _ = executed
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count is not None for c in code)
    assert not [o for c in code for o in c.outputs if o.output_type == "error"]
    plan_output = "".join(o.get("text", "") for c in code if "choose_layout" in c.source for o in c.outputs)
    assert "planner chose ddp" in plan_output and " ddp " in plan_output
