import os
import sys

# tests/ on the path so tests can import dist_utils; one thread per process: ranks share 2 cores.
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def demo_model():
    """The offline SmolLM2-135M-Instruct directory (built once per machine, ~1 min on a cold cache)."""
    from hf_dist.models import demo_model_dir

    return demo_model_dir()
