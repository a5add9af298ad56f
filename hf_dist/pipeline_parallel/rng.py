"""Dropout under pipeline parallelism: each pipeline rank draws its masks from its own random stream.

Every rank of a job is seeded alike (the Trainer's ``set_seed(seed)`` on every rank), and the ranks of one pipeline
run their stages on micro-batches of one shape. Drawing from the global generator, the second stage's layers
therefore drew exactly the masks of the first stage's layers, micro-batch by micro-batch (with 2 stages of 2
layers, layer 2 dropped the same positions as layer 0): not the independent masks of one process. So the schedule
runs inside ``pipeline_random_stream``: for each step the pipeline draws one number from the global generator
(the same on every rank: the user's seed, and a checkpoint's RNG state on resume) and seeds a stream from
it and the rank's pp coordinate, as torchtitan's ``set_determinism`` and Megatron-LM give each pipeline rank its
own seed. Tensor-parallel ranks of a stage share the stream (their replicated activations need the same masks);
data-parallel replicas share it as every DDP rank shares one seed. The global generator is left as it was, one
draw further on, so nothing else the job draws (data order, the next step) depends on how the stages split.

With dropout > 0 no layout reproduces one process bit for bit (each layout draws its masks in its own order and
shapes); parity with one process is proven, and checked by the layout canary, with dropout 0.
Not for: seeding the job (``transformers.set_seed``) or data order (``hf_dist.trainer.data``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

_STRIDE = 0x9E3779B97F4A7C15  # odd, so ranks map to distinct seeds (mod 2**64) for any step seed
_MASK64 = 2**64 - 1


def stage_seed(step_seed: int, pp_rank: int) -> int:
    """The seed of pp rank ``pp_rank``'s stream for a step whose shared seed is ``step_seed`` (pure)."""
    return (step_seed + _STRIDE * (pp_rank + 1)) & _MASK64


@contextlib.contextmanager
def pipeline_random_stream(pp_rank: int, device: torch.device) -> Iterator[None]:
    """Run the block on this pp rank's own stream for one step (CPU generator, and ``device``'s when CUDA).

    Activation checkpointing saves the state it finds inside the block and restores it to recompute, so its
    recomputed forward draws the masks of the original one.
    """
    step_seed = int(torch.randint(0, 2**62, (), dtype=torch.int64))  # global generator: one draw, every rank alike
    cuda = device.type == "cuda"
    index = (device.index if device.index is not None else torch.cuda.current_device()) if cuda else None
    with torch.random.fork_rng(devices=[index] if cuda else [], device_type="cuda"):
        seed = stage_seed(step_seed, pp_rank)
        torch.random.default_generator.manual_seed(seed)
        if cuda:
            torch.cuda.default_generators[index].manual_seed(seed)
        yield
