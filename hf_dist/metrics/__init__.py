"""``evaluate`` metric modules shipped with hf_dist (hub metrics cannot be loaded offline).

Each sub-folder holds one module file for ``evaluate.load("/abs/path/to/<name>.py")``; they are data files
of the package, not imported as Python modules. ``hf_dist.data.evaluation`` loads ``perplexity``.
"""
