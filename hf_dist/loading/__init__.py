"""Loading at scale: a model built on ``meta``, laid out, then each rank streams only its own slices.

``stream_weights`` fills any laid-out model from a safetensors directory, whatever laid it out (``stream.py``);
``build_on_meta`` builds the model to lay out (``meta.py``). Saving one gathered tensor at a time is
``hf_dist.state_dict.save_streaming``. The entry point that ties loading to
``DistTrainingArguments`` is ``hf_dist.from_pretrained`` (``hf_dist/trainer/pretrained.py``).
"""

from hf_dist.loading.meta import build_on_meta
from hf_dist.loading.stream import LoadReport, stream_weights

__all__ = ["LoadReport", "build_on_meta", "stream_weights"]
