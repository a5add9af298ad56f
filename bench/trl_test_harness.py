"""What the test package of ``trl_sft_fidelity`` imports: its conftest's ``install`` (the stand-in datasets, fp32
on a CPU, the count of trainers built, and the swap of TRL's classes for hf_dist's), its fixtures, and the names TRL's
tests import from their ``testing_utils``. Not a test module and not part of hf_dist.
"""

from __future__ import annotations

import functools
import os
import signal
import warnings

import pytest

from trl_sft_standins import HUB_DATASETS, load_standin_dataset

# ---- what the test package's conftest installs ------------------------------------------------------------------

# trainer -> TRL's class name -> hf_dist's replacement (module, name); configs too, so the tests build hf_dist's
SWAPS = {
    "sft": {"SFTTrainer": ("hf_dist.trainer.sft", "DistSFTTrainer"),
            "SFTConfig": ("hf_dist.trainer.sft", "DistSFTConfig")},
    "dpo": {"DPOTrainer": ("hf_dist.trainer.dpo", "DistDPOTrainer"),
            "DPOConfig": ("hf_dist.trainer.dpo", "DistDPOConfig")},
    "grpo": {"GRPOTrainer": ("hf_dist.trainer.grpo", "DistGRPOTrainer"),
             "GRPOConfig": ("hf_dist.trainer.grpo", "DistGRPOConfig")},
}


def install(swap: bool, trainer: str = "sft") -> None:
    """Redirect the Hub datasets, default TRL configs to fp32 where no bf16 GPU exists, record the class of every
    trainer built (``TRL_BUILT_LOG``), and (``swap``) replace ``trl.<X>Trainer`` / ``trl.<X>Config`` by hf_dist's
    classes before the test module imports them."""
    import importlib

    import datasets
    import torch
    import transformers
    import trl
    from trl.trainer import base_config
    from trl.trainer import utils as trl_utils

    original_load = datasets.load_dataset

    def load_dataset(path, name=None, *args, **kwargs):
        if path in HUB_DATASETS:
            return load_standin_dataset(path, name, **kwargs)
        return original_load(path, name, *args, **kwargs)

    datasets.load_dataset = load_dataset
    # TRL's configs default to bf16=True, which TrainingArguments refuses without a bf16 GPU: default to fp32 there
    # (a test's explicit bf16=True stays), identically for both runs
    original_post_init = base_config._BaseConfig.__post_init__

    def post_init(self):
        if self.bf16 is None and not torch.cuda.is_available():
            self.bf16 = False
        original_post_init(self)

    base_config._BaseConfig.__post_init__ = post_init
    if not hasattr(trl_utils, "get_kbit_device_map"):  # imported by older GRPO test files, used only under bnb
        def get_kbit_device_map():
            raise NotImplementedError("get_kbit_device_map is not in this trl (harness stand-in)")

        trl_utils.get_kbit_device_map = get_kbit_device_map
    log = os.environ.get("TRL_BUILT_LOG")
    if log:  # the swap is counted, not assumed: every Trainer built, by class
        original_init = transformers.Trainer.__init__

        def init(self, *args, **kwargs):
            config = kwargs["args"] if "args" in kwargs else (args[1] if len(args) > 1 else None)
            with open(log, "a") as out:
                out.write(f"{type(self).__module__}.{type(self).__qualname__} "
                          f"{type(config).__module__}.{type(config).__qualname__}\n")
            original_init(self, *args, **kwargs)

        transformers.Trainer.__init__ = init
    if swap:
        for name, (module, replacement) in SWAPS[trainer].items():
            setattr(trl, name, getattr(importlib.import_module(module), replacement))


def trainer_under_test(trainer: str) -> str:
    import trl

    return ", ".join(f"{name} -> {getattr(trl, name).__module__}.{getattr(trl, name).__qualname__}"
                     for name in SWAPS[trainer])


@pytest.fixture
def lazy_shared_datadir(tmp_path):
    """pytest-datadir's fixture, holding the one file the SFT tests read (a ChatML template of our own)."""
    folder = tmp_path / "shared_data"
    folder.mkdir()
    (folder / "template.jinja").write_text(
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
        "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
    return folder


@pytest.fixture(autouse=True)
def per_test_timeout():
    """Fail a test that runs past ``TRL_TEST_TIMEOUT`` seconds (no pytest-timeout here)."""
    seconds = int(os.environ.get("TRL_TEST_TIMEOUT", "300"))

    def expire(signum, frame):
        raise TimeoutError(f"test ran past {seconds} s (harness timeout)")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


# ---- the names the test module imports from its package's testing_utils ------------------------------------------

def _skip_unless(available: bool, what: str):
    return pytest.mark.skipif(not available, reason=f"test requires {what}")


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count()


require_bitsandbytes = _skip_unless(_has("bitsandbytes"), "bitsandbytes")
require_kernels = _skip_unless(_has("kernels"), "kernels")
require_liger_kernel = _skip_unless(_has("liger_kernel"), "liger-kernel")
require_peft = _skip_unless(_has("peft"), "peft")
require_peft_target_parameters = _skip_unless(_has("peft"), "peft with target_parameters")
require_torch_accelerator = _skip_unless(_cuda_count() > 0, "an accelerator")
require_torch_multi_accelerator = _skip_unless(_cuda_count() > 1, "several accelerators")
require_vllm = _skip_unless(_has("vllm"), "vllm")
require_vision = _skip_unless(_has("PIL"), "vision (PIL)")
xfail_data_parallel = pytest.mark.xfail(_cuda_count() > 1, reason="nn.DataParallel")


def is_ampere_or_newer(device_index: int = 0) -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.get_device_capability(device_index) >= (8, 0)


require_ampere_or_newer = _skip_unless(is_ampere_or_newer(), "an Ampere or newer GPU")


class TrlTestCase:
    @pytest.fixture(autouse=True)
    def set_tmp_dir(self, tmp_path):
        self.tmp_dir = str(tmp_path)


def ignore_warnings(message: str | None = None, category: type[Warning] = Warning):
    def decorator(test):
        @functools.wraps(test)
        def wrapper(*args, **kwargs):
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=message or "", category=category)
                return test(*args, **kwargs)

        return wrapper

    return decorator
