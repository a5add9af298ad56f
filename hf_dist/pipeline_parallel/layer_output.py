"""What a model's decoder layers return, read from the model's own code: a tensor, or a tuple of n.

A pipeline stage replaces the layers another stage owns by stand-ins (``stage_module._StandIn``) that hand the
received hidden states to the base model's layer loop in the form that loop expects. That form changes with
transformers' versions (5.24: GPT-J and CodeGen blocks return a tensor; 5.23: a tuple the loop reads ``[0]`` of), so
it is read from the loop itself -- the ``forward`` of the module that owns the decoder-layer list:

- ``hidden_states = layer(...)``: a tensor (0);
- ``a, b = layer(...)``: a tuple unpacked into that many names (Bamba: 2);
- ``outputs = layer(...)`` and ``outputs[...]`` in the loop: a tuple read by index (Falcon, BLOOM, MPT: 1 is enough).

Read once per class (``functools.cache``). The registry's ``Family.pp_layer_output`` overrides it for a type whose
loop this reader cannot follow; a loop it cannot follow and no override is an error naming the class.
Pure: classes in, a number out (no weights, no forward). Not for: building stages (``stage_module``).
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap


def _loop_width(source: str, layers_attr: str) -> int | None:
    """The width for the first ``for`` loop over ``self.<layers_attr>`` in ``source`` that calls its loop variable."""
    for loop in ast.walk(ast.parse(source)):
        if not isinstance(loop, ast.For) or not any(
            isinstance(n, ast.Attribute) and n.attr == layers_attr and isinstance(n.value, ast.Name)
            and n.value.id == "self" for n in ast.walk(loop.iter)
        ):
            continue
        names = {n.id for n in ast.walk(loop.target) if isinstance(n, ast.Name)}
        for node in (n for stmt in loop.body for n in ast.walk(stmt)):
            call = node.value if isinstance(node, ast.Assign) else None
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id in names):
                continue
            target = node.targets[0]
            if isinstance(target, ast.Tuple):
                return len(target.elts)
            if isinstance(target, ast.Name):
                indexed = any(isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name)
                              and n.value.id == target.id for stmt in loop.body for n in ast.walk(stmt))
                return 1 if indexed else 0
    return None


@functools.cache
def layer_loop_width(owner: type, layers_attr: str) -> int | None:
    """0 when ``owner.forward`` takes its layers' output (``self.<layers_attr>``) as a tensor, n for a tuple of n;
    ``None`` when its source has no such loop (or no source)."""
    for cls in owner.__mro__:
        if "forward" not in vars(cls):
            continue
        try:
            source = textwrap.dedent(inspect.getsource(vars(cls)["forward"]))
        except (OSError, TypeError):
            return None
        return _loop_width(source, layers_attr)
    return None


def layer_output_width(owner: type, layers_attr: str, model_type: str | None) -> int:
    """The width a stand-in returns in the loop of ``owner`` (the module holding the decoder-layer list as
    ``layers_attr``): the registry's override for ``model_type`` when set, else what the code says."""
    from hf_dist.families import family

    override = family(model_type).pp_layer_output
    if override is not None:
        return override
    width = layer_loop_width(owner, layers_attr)
    if width is None:
        raise ValueError(
            f"cannot read how {owner.__name__}.forward takes the output of its decoder layers (self.{layers_attr}) "
            f"for model_type={model_type!r}; set pp_layer_output in its hf_dist.families record"
        )
    return width
