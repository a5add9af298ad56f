"""Loading at scale: a model built on ``meta``, laid out, then each rank streams only its own slices; saving
one gathered tensor at a time.

``load_checkpoint`` fills any laid-out model from a safetensors directory, whatever laid it out (``stream.py``);
``build_on_meta`` builds the model to lay out (``meta.py``); ``save_streaming`` writes it back (``save.py``).
The entry point that ties them to ``DistTrainingArguments`` is ``hf_dist.from_pretrained``
(``hf_dist/trainer/pretrained.py``).
"""

from hf_dist.loading.meta import build_on_meta
from hf_dist.loading.save import save_streaming
from hf_dist.loading.stream import LoadReport, load_checkpoint

__all__ = ["LoadReport", "build_on_meta", "load_checkpoint", "save_streaming"]
