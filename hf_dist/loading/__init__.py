"""Loading at scale: a model built on ``meta``, laid out, then each rank streams only its own slices.

``from_pretrained`` (also ``hf_dist.from_pretrained``) is the entry point; ``load_checkpoint`` fills any
laid-out model from a safetensors directory, whatever laid it out. See ``stream.py`` and ``pretrained.py``.
"""

from hf_dist.loading.pretrained import build_on_meta, from_pretrained, layout_dtype
from hf_dist.loading.stream import LoadReport, load_checkpoint

__all__ = ["LoadReport", "build_on_meta", "from_pretrained", "layout_dtype", "load_checkpoint"]
