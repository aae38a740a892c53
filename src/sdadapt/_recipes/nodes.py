"""Recipes: small expression trees that say how a target tensor is made from source tensors.

A plan maps every target key to one :class:`Node`; a box is a tuple of ``(start, stop)`` pairs in
global coordinates. A node kind is a dataclass with a global ``shape`` and ``dtype`` and:

- ``produce(box, dest, out)``: the steps that leave ``dest`` (the box's shape, any dtype) holding
  ``output[box].to(dest.dtype)``: a :class:`Piece` (a region of a source tensor copied into a view
  of ``dest``), a :class:`Fill` (a view set to one value) or a :class:`Compute` (values computed
  from the regions of the node's children that it declares as its ``inputs``: a host function
  ``fn(io)``, or a :class:`Kernel` on the inputs' values that may run on the destination's
  device). A node that only moves data (concat, narrow, transpose, stack...) maps the box to
  boxes of its children and recurses with views of ``dest`` (:func:`emit`). A cast recurses only
  where ``copy_`` computes exactly the cast, so a lossy chain (f32 -> int32 -> f32) truncates.
- ``full(io)``: the whole output computed eagerly on full tensors, written independently of
  ``produce``: the reference the region path is tested against.
- ``describe()``: a one-line text form for reports.
- ``source_region(box)``, where it applies: the region as one stored region of a source tensor
  (:class:`Read`), for a leaf and the nodes that narrow or select one.

Derived, never written per node: ``read(box, io)`` (run the box's steps into a new tensor; one
piece filling the whole box is returned as read, uncopied), ``steps``, ``children`` and ``leaves``.
Nothing in a node is specific to the engine, which plans from the steps alone: how a computation
may be cut in bands (:class:`Bands`) and its device kernel (:class:`Kernel`) are data of the
:class:`Compute`. A node that computes its values may also produce them in another dtype directly
(``as_dtype``: a dequantisation to float32 rather than bfloat16 and widened); nodes that only move
data (:class:`Rearrangement`) can whenever all their children can.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from .._base.regions import Box, box_shape, full_box


class SourceIO(Protocol):
    """Where leaves get their bytes: ``read(key, box)`` returns that region of a source tensor.
    A source whose regions live on a device may say so in a ``device`` attribute: the regions
    :meth:`Node.read` assembles from several reads are then made there (else on the host)."""

    def read(self, key: str, box: Box) -> torch.Tensor: ...


def with_dim(box: Box, dim: int, span: tuple[int, int]) -> Box:
    """``box`` with dimension ``dim`` replaced by ``span``."""
    return box[:dim] + (span,) + box[dim + 1 :]


def with_dim_shape(shape: tuple[int, ...], dim: int, size: int) -> tuple[int, ...]:
    """``shape`` with dimension ``dim`` replaced by ``size``."""
    return shape[:dim] + (size,) + shape[dim + 1 :]


# --- steps: what producing a region takes ------------------------------------------------------
# A plan makes them per region, and they hold tensors: plain dataclasses with no generated
# __eq__ or __repr__ (a tensor's == is no truth value, its repr no help; each generated method,
# and a frozen class's __setattr__ / __delattr__, costs the import an exec, and a frozen field is
# set through object.__setattr__ each time one is made).


@dataclass(eq=False, repr=False)
class Piece:
    """Region ``box`` of source tensor ``key`` goes into ``dest`` (same shape; ``copy_``
    converts the dtype)."""

    key: str
    box: Box
    dest: torch.Tensor

    def run(self, io: SourceIO) -> None:
        self.dest.copy_(io.read(self.key, self.box))


@dataclass(eq=False, repr=False)
class Fill:
    """``dest`` is set to ``value`` (already rounded to the producing node's dtype)."""

    dest: torch.Tensor
    value: bool | int | float

    def run(self, io: SourceIO) -> None:
        self.dest.fill_(self.value)


@dataclass(frozen=True)
class Read:
    """Region ``box`` of source tensor ``key`` as stored (``dtype``), viewed as ``shape`` (the box's
    shape, less the dims a selection drops)."""

    key: str
    box: Box
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(eq=False, repr=False)
class Input:
    """Region ``box`` of ``node`` (a child of the computing node), one value a computation works
    on; ``read``: that region as a stored region (:meth:`Node.source_region`), or ``None``."""

    node: Node
    box: Box
    read: Read | None = field(init=False)

    def __post_init__(self) -> None:
        self.read = self.node.source_region(self.box)

    def value(self, io: SourceIO) -> torch.Tensor:
        """The region's values, read from ``io``."""
        return self.node.read(self.box, io)


@dataclass(frozen=True)
class Kernel:
    """Arithmetic that may run on the destination's device: ``run(dest, *values)`` writes ``dest``
    from the inputs' values with plain tensor ops (the same bits on any device, allocating on the
    inputs' device). Equal ``kind``: the same device kernels; ``sample``: a small region at the
    node's origin, of whole blocks, that runs them all (what a warm-up computes)."""

    run: Callable[..., None]
    kind: object
    sample: Box


@dataclass(frozen=True)
class Bands:
    """How a computation's region may be cut into bands (sub-regions computed apart): about
    ``value_bytes`` of input per output value; cuts along dim ``d`` (never the last) fall on
    multiples of ``align``'s ``(d, size)`` (absolute coordinates; other dims: anywhere)."""

    value_bytes: float
    align: tuple[tuple[int, int], ...] = ()


@dataclass(eq=False, repr=False)
class Compute:
    """Region ``box`` of ``node``'s output (its dtype), copied into ``dest``, computed from the
    regions of ``node``'s children that ``inputs`` declares. Either ``fn(io)`` reads them through
    the children's ``read`` and computes on the host, or ``kernel`` computes from their values
    (:class:`Kernel`): the engine may then read the inputs, copy them to ``dest.device`` and run
    it there (raw, often smaller, bytes cross PCIe). ``bands``: how the engine may cut the region
    (:class:`Bands`); ``None``: it is computed whole.

    Args:
        node: the node whose region this is.
        box: the region, ``((start, stop), ...)`` per dim of the node's output.
        dest: where the region's values go.
        fn: ``fn(io) -> tensor``: the host form.
        inputs: the children's regions it reads (:class:`Input`).
        kernel: the arithmetic on the inputs' values (:class:`Kernel`), for the device form.
        bands: how the engine may cut the region into bands (:class:`Bands`).

    Example::

        out.append(sdadapt.rules.Compute(self, box, dest, lambda io: -self.child.read(box, io)))
    """

    node: Node
    box: Box
    dest: torch.Tensor
    fn: Callable[[SourceIO], torch.Tensor] | None = None
    inputs: tuple[Input, ...] = ()
    kernel: Kernel | None = None
    bands: Bands | None = None

    def __post_init__(self) -> None:
        if (self.fn is None) == (self.kernel is None):
            raise ValueError("Compute takes either fn, or inputs and kernel")

    @property
    def on_device(self) -> bool:
        """The kernel may run on the destination's device (the ``kernel`` form)."""
        return self.kernel is not None

    def run(self, io: SourceIO) -> None:
        """Compute the region into ``dest``, here (the engine runs a kernel on a GPU through
        its device lane instead: :mod:`sdadapt._engine.device`)."""
        if self.fn is not None:
            self.dest.copy_(self.fn(io))
            return
        assert self.kernel is not None
        self.kernel.run(self.dest, *(i.value(io) for i in self.inputs))


Step = Piece | Fill | Compute


def emit(node: Node, box: Box, dest: torch.Tensor, out: list[Step]) -> None:
    """Append the steps that produce region ``box`` of ``node`` into ``dest``; an empty box
    needs none. Nodes call this for their children.

    Args:
        node: the child node.
        box: the region of its output.
        dest: where it goes (a view of the parent's destination).
        out: the step list the parent's ``produce`` appends to.

    Returns:
        Nothing: the steps are appended to ``out``.

    Example::

        def produce(self, box, dest, out):  # a node that passes its child through
            sdadapt.rules.emit(self.child, box, dest, out)
    """
    if any(a >= b for a, b in box):
        return
    node.produce(box, dest, out)


def _covers(view: torch.Tensor, whole: torch.Tensor) -> bool:
    """``view`` is all of ``whole`` (same memory, shape and strides)."""
    return view.data_ptr() == whole.data_ptr() and view.shape == whole.shape and view.stride() == whole.stride()


class Node:
    """A recipe node; see the module docstring for the protocol.

    A rule of one's own returns one from ``transform`` (value rules) or puts one under a key
    (``ctx.put``); the node says its output's shape and dtype, how a region of it is produced
    (``produce``: steps appended to ``out``, see :class:`Compute` and :func:`emit`), its whole
    value computed eagerly (``full``, the reference the loads are tested against) and a text
    form (``describe``).

    Attributes:
        shape: the output's global shape.
        dtype: the output's dtype.

    Example::

        @dataclass(frozen=True)
        class NegNode(sdadapt.rules.Node):
            shape: tuple[int, ...]
            dtype: torch.dtype
            child: sdadapt.rules.Node

            def produce(self, box, dest, out):
                out.append(sdadapt.rules.Compute(self, box, dest, lambda io: -self.child.read(box, io)))

            def full(self, io):
                return -self.child.full(io)

            def describe(self):
                return f"-({self.child.describe()})"
    """

    shape: tuple[int, ...]
    dtype: torch.dtype

    def produce(self, box: Box, dest: torch.Tensor, out: list[Step]) -> None:
        """Append the steps that leave ``dest`` holding ``output[box].to(dest.dtype)``."""
        raise NotImplementedError

    def full(self, io: SourceIO) -> torch.Tensor:
        """The whole output, computed eagerly (the reference)."""
        raise NotImplementedError

    def describe(self) -> str:
        """A one-line text form of the recipe."""
        raise NotImplementedError

    def source_region(self, box: Box) -> Read | None:
        """Region ``box`` of the output as one stored region of a source tensor (a leaf, a narrow
        or selection of one...), whose bytes ``read`` hands out as they are; ``None`` (default)
        where the values are computed or come from several regions."""
        return None

    def as_dtype(self, dtype: torch.dtype) -> Node | None:
        """This recipe producing ``dtype`` itself, where it computes its values and can compute
        them in ``dtype`` (a dequantisation into float32 rather than into bfloat16 and then
        widened); ``None`` (the default) where only a cast of its output gives ``dtype``. The
        cast rule asks for it: casting a narrower result would round the values first."""
        return None

    def follows_target_dtype(self) -> bool:
        """Whether this recipe's values have no dtype of their own and take the one the target
        holds (a dequantisation given no ``dtype=``): the plan then asks :meth:`as_dtype` for the
        target's dtype instead of reporting a mismatch. ``False`` by default."""
        return False

    def input_fields(self) -> list[tuple[str, Node | tuple[Node, ...]]]:
        """The dataclass fields given at construction that hold a node or a tuple of nodes,
        with their values (the fields derived in ``__post_init__`` left out)."""
        if not dataclasses.is_dataclass(self):
            return []
        out: list[tuple[str, Node | tuple[Node, ...]]] = []
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.init and (isinstance(v, Node) or (isinstance(v, tuple) and v and all(isinstance(p, Node) for p in v))):
                out.append((f.name, v))
        return out

    def children(self) -> tuple[Node, ...]:
        """The input nodes, in field order (see :meth:`input_fields`)."""
        kids: list[Node] = []
        for _, v in self.input_fields():
            kids.extend(v if isinstance(v, tuple) else (v,))
        return tuple(kids)

    def leaves(self) -> list[str]:
        """The source keys this recipe reads, in order (repeats kept)."""
        return [k for c in self.children() for k in c.leaves()]

    def steps(self, box: Box, dest: torch.Tensor) -> list[Step]:
        """The steps that produce region ``box`` into ``dest``."""
        out: list[Step] = []
        emit(self, box, dest, out)
        return out

    def read(self, box: Box, io: SourceIO) -> torch.Tensor:
        """Region ``box`` of the output, reading from ``io`` only what the box needs (made on
        ``io.device`` where the source has one, else on the host)."""
        out = torch.empty(box_shape(box), dtype=self.dtype, device=getattr(io, "device", None))
        steps = self.steps(box, out)
        if len(steps) == 1 and isinstance(steps[0], Piece) and _covers(steps[0].dest, out):
            return io.read(steps[0].key, steps[0].box).to(self.dtype)
        for step in steps:
            step.run(io)
        return out


class Rearrangement(Node):
    """A node whose values are its children's, moved (concat, narrow, transpose, stack...): it
    produces another dtype exactly when all its children do."""

    def as_dtype(self, dtype: torch.dtype) -> Node | None:
        changes: dict[str, object] = {}
        for name, v in self.input_fields():
            parts = tuple(p.as_dtype(dtype) for p in (v if isinstance(v, tuple) else (v,)))
            if any(p is None for p in parts):
                return None
            changes[name] = parts if isinstance(v, tuple) else parts[0]
        return dataclasses.replace(self, **changes) if changes and dataclasses.is_dataclass(self) else None

    def follows_target_dtype(self) -> bool:
        kids = self.children()
        return bool(kids) and all(c.follows_target_dtype() for c in kids)


@dataclass(frozen=True, eq=False)
class Derived(Node):
    """A node whose shape and dtype follow from its other fields: they are not arguments, and its
    ``__post_init__`` sets them once with :meth:`derive`."""

    shape: tuple[int, ...] = field(init=False)
    dtype: torch.dtype = field(init=False)

    def derive(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "dtype", dtype)


@dataclass(frozen=True, eq=False)
class RoundedOnce(Derived):
    """A node that computes in a wider float and rounds once to its dtype: ``out_dtype`` (a
    keyword), else the one its ``__post_init__`` derives from its input."""

    out_dtype: torch.dtype | None = field(default=None, kw_only=True)

    def as_dtype(self, dtype: torch.dtype) -> Node | None:
        """The same computation, rounded once to ``dtype`` (any floating dtype): no value is
        rounded twice, as a cast of a narrower result would (a bf16 Gemma norm's ``1 + w`` into a
        float32 model is exact)."""
        return dataclasses.replace(self, out_dtype=dtype) if dtype.is_floating_point else None


@dataclass(frozen=True, eq=False)
class Leaf(Node):
    """A tensor of the source checkpoint, as stored."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    def produce(self, box: Box, dest: torch.Tensor, out: list[Step]) -> None:
        out.append(Piece(self.key, box, dest))

    def full(self, io: SourceIO) -> torch.Tensor:
        return io.read(self.key, full_box(self.shape)).clone()

    def leaves(self) -> list[str]:
        return [self.key]

    def source_region(self, box: Box) -> Read | None:
        return Read(self.key, box, self.dtype, box_shape(box))

    def read(self, box: Box, io: SourceIO) -> torch.Tensor:
        return io.read(self.key, box)  # what io hands out, uncopied (a view of a staged read)

    def describe(self) -> str:
        return self.key


@dataclass(frozen=True, eq=False)
class Converted(Node):
    """The input converted to ``dtype``."""

    child: Node
    dtype: torch.dtype
    shape: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", self.child.shape)

    def produce(self, box: Box, dest: torch.Tensor, out: list[Step]) -> None:
        if dest.dtype == self.dtype or self.child.dtype == self.dtype:
            emit(self.child, box, dest, out)  # copy_ into dest is exactly this cast
        else:
            out.append(Compute(self, box, dest, functools.partial(self._cast, box), (Input(self.child, box),)))

    def source_region(self, box: Box) -> Read | None:
        return self.child.source_region(box) if self.child.dtype == self.dtype else None

    def _cast(self, box: Box, io: SourceIO) -> torch.Tensor:
        return self.child.read(box, io).to(self.dtype)

    def full(self, io: SourceIO) -> torch.Tensor:
        return self.child.full(io).to(self.dtype)

    def describe(self) -> str:
        return f"cast({self.child.describe()}, {str(self.dtype).removeprefix('torch.')})"
