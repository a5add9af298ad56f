"""End to end: the Harbor recipe with ``--pp_size 2 --global_batch_size 8`` under ``accelerate launch``.

The recipe's collator pads each batch to its longest row, so sequence lengths change from step to step (what
crashed the old stages); the pipeline's run must equal a single-process run of the same recipe (fp32,
``parity.assert_parity``: logged losses, gradient norms and the saved final weights).
"""

import pytest

from launch_harness import COMMON, launch, launched_run, one_process
from parity import assert_parity

# the preset's 256 tokens: transcripts are 36-500 tokens, so the longest row (the padded length) differs per step
LONGER = ["--max_seq_len", "256"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    one_process(out, *LONGER)
    return launched_run(out)


def test_recipe_trains_with_pp2_and_global_batch_8(reference, tmp_path):
    assert "--global_batch_size" in COMMON and COMMON[COMMON.index("--global_batch_size") + 1] == "8"
    summary = launch("ddp", tmp_path, *LONGER, "--pp_size", "2")
    assert summary["layout"].endswith("PP2"), summary["layout"]
    run = launched_run(tmp_path)
    assert len(run["losses"]) == 5
    assert_parity(run, reference, what="PP2")
    assert summary["reload"].startswith("AutoModelForCausalLM.from_pretrained: ok")
