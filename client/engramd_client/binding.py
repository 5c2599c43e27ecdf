"""Put a set's tensors into a PyTorch module in place of its parameters, without a copy.

Engines keep Engram tables as parameters (or buffers) of their modules. A
worker builds the module as usual, with the tables on the meta device (no
memory), attaches, and binds:

    model = build_model(device_for_tables="meta")
    tables = attach("/models/ckpt")
    bind(model, tables, layer_names({
        "model.layers.{L}.engram.embedding.weight": "layers.{L}.engram.embed.weight",
    }))

Every pair is checked (the parameter exists, the tensor exists, shape and
dtype agree) before anything changes: a mismatch raises BindError naming
both sides and leaves the module as it was. A bound parameter is a
`torch.nn.Parameter` over the tensor itself (same memory, no gradient); a
buffer is the tensor. Closing the tables puts the module's own tensors back,
so the module never reads memory whose lease has ended.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

import torch

from engramd_client.tables import Tables

#: How bind() learns which tensor goes where: {parameter name: tensor name}, or a
#: function from a parameter (or buffer) name to a tensor name (None: not bound).
Names = Mapping[str, str] | Callable[[str], str | None]


class BindError(ValueError):
    """The module and the tables do not agree: names each parameter and tensor involved."""


def layer_names(templates: Mapping[str, str]) -> Callable[[str], str | None]:
    """Names for bind() from templates with a layer number {L} on both sides.

    {"model.layers.{L}.engram.embedding.weight": "layers.{L}.engram.embed.weight"}
    binds parameter model.layers.3.engram.embedding.weight to tensor
    layers.3.engram.embed.weight, for every layer; other parameters are left.
    """
    patterns = []
    for param, tensor in templates.items():
        if "{L}" not in param or "{L}" not in tensor:
            raise ValueError(f"{param!r} -> {tensor!r}: both templates need the layer as {{L}}")
        regex = re.escape(param).replace(re.escape("{L}"), r"(?P<L>\d+)", 1)
        patterns.append((re.compile(regex + "$"), tensor))

    def tensor_for(name: str) -> str | None:
        for regex, tensor in patterns:
            match = regex.match(name)
            if match:
                return tensor.replace("{L}", match.group("L"))
        return None

    return tensor_for


def bind(
    module: torch.nn.Module,
    tables: Mapping[str, torch.Tensor],
    names: Names,
    *,
    cuda: bool = False,
) -> dict[str, str]:
    """Replace the module's parameters or buffers with the tables' tensors (no copy, no grad).

    Returns {parameter name: tensor name} of what was bound. Raises
    BindError, changing nothing, on an unknown parameter or tensor name, a
    shape or dtype mismatch, or when `names` matches nothing. With a
    `Tables`, closing it puts the module's own tensors back. `cuda=True`
    binds the tables' CUDA views (`Tables.cuda`, attach(device=...)).
    """
    if cuda and not (isinstance(tables, Tables) and tables.device is not None):
        raise BindError("cuda=True needs tables attached with device='cuda:N'")
    tensor_of = tables.cuda if cuda and isinstance(tables, Tables) else tables.__getitem__
    own: dict[str, torch.Tensor] = dict(module.named_parameters(remove_duplicate=False))
    own.update(module.named_buffers(remove_duplicate=False))
    if callable(names):
        pairs = {p: t for p in own if (t := names(p)) is not None}
        if not pairs:
            raise BindError(
                f"the names matched none of the module's {len(own)} parameters and buffers "
                f"(such as {', '.join(list(own)[:3]) or 'none'})"
            )
    else:
        pairs = dict(names)
    problems = []
    for param, tensor in pairs.items():
        if param not in own:
            problems.append(f"{param} -> {tensor}: the module has no parameter or buffer {param}")
        elif tensor not in tables:
            problems.append(f"{param} -> {tensor}: the tables hold no tensor {tensor}")
        else:
            mine, theirs = own[param], tensor_of(tensor)
            if mine.shape != theirs.shape or mine.dtype != theirs.dtype:
                problems.append(f"{param} is {_describe(mine)} but {tensor} is {_describe(theirs)}")
    if problems:
        raise BindError("cannot bind; nothing was changed:\n  " + "\n  ".join(problems))
    bound = []
    for param, tensor in pairs.items():
        slot = _Slot.of(module, param)
        new = torch.nn.Parameter(tensor_of(tensor), False) if slot.is_param else tensor_of(tensor)
        slot.bind(new)
        bound.append((slot, new))
    if isinstance(tables, Tables):
        tables.when_closed(lambda: _unbind(bound))
    return pairs


def _describe(t: torch.Tensor) -> str:
    return f"{list(t.shape)} {str(t.dtype).removeprefix('torch.')}"


#: The attribute of a submodule that keeps its own tensors while tables are bound in their place.
_OWN = "_engramd_own_tensors"


class _Slot:
    """Where a module holds a parameter or buffer: the owning submodule and its attribute."""

    def __init__(self, owner: torch.nn.Module, attr: str) -> None:
        self.owner, self.attr = owner, attr
        self.is_param = attr in owner._parameters
        self._held = owner._parameters if self.is_param else owner._buffers
        self._own: dict[str, torch.Tensor | None] = owner.__dict__.setdefault(_OWN, {})

    @classmethod
    def of(cls, module: torch.nn.Module, name: str) -> _Slot:
        owner, _, attr = name.rpartition(".")
        return cls(module.get_submodule(owner), attr)

    def holds(self, tensor: torch.Tensor) -> bool:
        return self._held[self.attr] is tensor

    def bind(self, tensor: torch.Tensor) -> None:
        """Hold `tensor`, keeping the module's own tensor (from before any binding) aside."""
        self._own.setdefault(self.attr, self._held[self.attr])
        self._held[self.attr] = tensor  # type: ignore[assignment]

    def unbind(self) -> None:
        """Hold the module's own tensor again."""
        self._held[self.attr] = self._own.pop(self.attr)  # type: ignore[assignment]


def _unbind(bound: list[tuple[_Slot, torch.Tensor]]) -> None:
    # Only where this binding is still in place: a module bound since to
    # refreshed tables (Tables.refresh) keeps that binding when these close.
    for slot, tensor in bound:
        if slot.holds(tensor):
            slot.unbind()
