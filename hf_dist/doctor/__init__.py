"""``hf-dist doctor``: check a machine (and, under a launcher, the links between ranks) before a long run.

* ``env`` -- versions, CUDA/NCCL/gloo, devices and memory, DeepSpeed ops (probed, never compiled).
* ``probe`` -- the all-reduce probe: bus bandwidth per message size as nccl-tests defines it, a result check,
  and straggler warnings.

Not here: training or configs; the CLI glue is ``hf_dist.cli.doctor``.
"""

from hf_dist.doctor.env import EnvReport, collect_env, format_env
from hf_dist.doctor.probe import ProbeResult, ProbeRow, bus_factor, format_probe, run_probe, stragglers

__all__ = [
    "EnvReport",
    "ProbeResult",
    "ProbeRow",
    "bus_factor",
    "collect_env",
    "format_env",
    "format_probe",
    "run_probe",
    "stragglers",
]
