"""Stacked projections: the FP8 layers a module calls one after another on the same input (an
attention's ``q_proj``, ``k_proj``, ``v_proj``) run as one GEMM over their stacked weights.

At decode sizes a GEMM's time is its weight bytes at the copy rate plus a few microseconds of
fixed cost (launch, the first loads' latency, the tail, the epilogue: docs/small-m.md), and each
FP8 layer also quantizes its input. Llama-3-8B's k_proj and v_proj are 4 MB each: on their own
they cost about as much fixed time as bytes. Stacked, the attention's three projections quantize
the input once and stream one weight.

The attention module stays the model's own (its forward is not rewritten): its projections are
replaced by an :class:`FP8StackedLinear` (the first) and :class:`FP8StackMember` layers (the
others). The first computes the whole stack and keeps the members' rows for this input; a
member called with that same tensor returns its rows, and computes its own GEMM otherwise (any
other input, or the same tensor changed in place since), so the result never depends on
whether the module calls them as expected. :func:`fuse_stacked_projections` replaces only
projections whose parent's forward calls them in order on one variable
(:func:`calls_on_one_input`), where the stacked GEMM is always used.

Checkpoint layout: each projection keeps its own ``weight``, ``weight_scale_inv`` and ``bias``
(the Hugging Face names), as views of the first layer's stacked buffers (not saved themselves),
as :class:`~tmagemm.nn.FP8GatedMLP` does for gate/up.
"""

from __future__ import annotations

import ast
import functools

import torch
from torch import nn

from .handoff import Handoff
from .linear import ACTIVATION_DTYPES, FP8Linear, keep_dtypes
from .quantize import SCALE_BLOCK, quantize_weight
from .source import forward_def, self_call

# The projections stacked per attention module, in the order its forward calls them.
QKV = ("q_proj", "k_proj", "v_proj")
RECIPES = ("block", "row")  # tensor-wise layers have one scale each: their weights do not stack


@functools.lru_cache(maxsize=None)
def calls_on_one_input(cls: type, names: tuple[str, ...] = QKV) -> bool:
    """Whether ``cls.forward`` calls ``self.<name>(v)`` for each of ``names`` exactly once, in that
    order, on the same variable ``v``, with no assignment to ``v`` between the first call and the
    last (read from its source; False where there is none)."""
    tree = forward_def(cls)
    if tree is None:
        return False
    calls: dict[str, list[tuple[int, int, str]]] = {name: [] for name in names}
    stores: list[tuple[int, int, str]] = []
    for node in ast.walk(tree):
        call = self_call(node)
        if call is not None and call[0] in calls:
            arg = node.args[0].id if len(node.args) == 1 and isinstance(node.args[0], ast.Name) else ""
            calls[call[0]].append((node.lineno, node.col_offset, "" if node.keywords else arg))
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            stores.append((node.lineno, node.col_offset, node.id))
    if any(len(found) != 1 for found in calls.values()):
        return False
    ordered = [calls[name][0] for name in names]
    variable = ordered[0][2]
    if not variable or any(c[2] != variable for c in ordered) or ordered != sorted(ordered):
        return False
    first, last = ordered[0][:2], ordered[-1][:2]
    return not any(first < s[:2] < last and s[2] == variable for s in stores)


def stack_reason(parent: nn.Module, recipe: str = "block", names: tuple[str, ...] = QKV) -> str | None:
    """None when the projections ``names`` of ``parent`` can be stacked, else why not: the parent's
    forward calls them in order on one input (:func:`calls_on_one_input`); each an nn.Linear or an
    FP8Linear (exact types), all with a bias of one dtype or none with one (Qwen2's q/k/v have
    biases), one in_features, on one device; the recipe (the
    FP8Linear layers' one, else ``recipe``) "block" or "row"; for "block" every out_features a
    multiple of 128 (so the 128 x 128 weight scales stack)."""
    layers = [getattr(parent, name, None) for name in names]
    if any(not isinstance(layer, nn.Module) for layer in layers):
        return f"{type(parent).__name__} lacks one of {', '.join(names)}"
    if any(isinstance(layer, (FP8StackedLinear, FP8StackMember)) for layer in layers):
        return "already stacked"
    for layer, name in zip(layers, names):
        if type(layer) not in (nn.Linear, FP8Linear):
            return f"{name} is a {type(layer).__name__}, not an nn.Linear or FP8Linear"
    biases = {None if layer.bias is None else layer.bias.dtype for layer in layers}
    if len(biases) > 1:
        return f"biases differ: {[None if layer.bias is None else layer.bias.dtype for layer in layers]}"
    if not calls_on_one_input(type(parent), names):
        return f"{type(parent).__name__}.forward does not call {', '.join(names)} in order on one input"
    if len({layer.in_features for layer in layers}) > 1:
        return f"in_features differ: {[layer.in_features for layer in layers]}"
    recipes = {layer.recipe for layer in layers if type(layer) is FP8Linear}
    if len(recipes) > 1:
        return f"the FP8Linear projections have several recipes ({sorted(recipes)})"
    recipe = _stack_recipe(layers, recipe)
    if recipe not in RECIPES:
        return f"recipe {recipe!r}: only 'block' and 'row' weights stack (tensor-wise layers have a scale each)"
    if recipe == "block" and any(layer.out_features % SCALE_BLOCK for layer in layers):
        return f"out_features {[layer.out_features for layer in layers]} not all multiples of {SCALE_BLOCK}"
    if len({layer.weight.device for layer in layers}) > 1:
        return "the projections are on several devices"
    return None


def _stack_recipe(layers, recipe: str) -> str:
    """The recipe of a stack: its FP8Linear layers' one, else ``recipe`` (nn.Linear layers are
    quantized with it)."""
    return next((layer.recipe for layer in layers if type(layer) is FP8Linear), recipe)


class FP8StackedLinear(FP8Linear):
    """The first projection of a stack: ``y = x @ W.T`` with W its rows of the stacked weight.

    Buffers ``stacked_weight`` (sum of out_features, K) e4m3, ``stacked_weight_scale_inv`` (the
    recipe's scales of the stacked weight) and, with ``bias``, ``stacked_bias`` (of ``dtype``) are
    what the GEMM reads (not saved); the layer's own ``weight`` / ``weight_scale_inv`` / ``bias``
    and its members' are views of their rows. forward(x) runs one GEMM for the whole stack,
    returns this layer's rows and hands each member its rows for the same x. Build with
    :meth:`stack`.
    """

    def __init__(self, in_features: int, out_features: tuple[int, ...], bias: bool = False, recipe: str = "block",
                 dtype: torch.dtype = torch.bfloat16, device=None):
        super().__init__(in_features, out_features[0], False, recipe, dtype, device="meta")
        if recipe not in RECIPES:
            raise ValueError(f"{type(self).__name__}: recipe {recipe!r} does not stack (one scale per layer); "
                             f"use one of {RECIPES}")
        if recipe == "block" and any(n % SCALE_BLOCK for n in out_features):
            raise ValueError(f"{type(self).__name__}: out_features {out_features} must be multiples of {SCALE_BLOCK} "
                             "(each layer's rows cover whole 128 x 128 scale blocks)")
        self.out_sizes = tuple(out_features)
        total = sum(out_features)
        scale_rows = total // SCALE_BLOCK if recipe == "block" else total
        scale_cols = -(-in_features // SCALE_BLOCK) if recipe == "block" else 1
        self.register_buffer("stacked_weight", torch.zeros(total, in_features, dtype=torch.float8_e4m3fn,
                                                           device=device), persistent=False)
        self.register_buffer("stacked_weight_scale_inv", torch.ones(scale_rows, scale_cols, dtype=torch.float32,
                                                                    device=device), persistent=False)
        self.register_buffer("stacked_bias", torch.zeros(total, dtype=dtype, device=device) if bias else None,
                             persistent=False)
        self.members: list[FP8StackMember] = []  # a plain list: the members are the parent's children
        self.handoff = Handoff()  # the members' rows of the last forward, for the same x
        self._tie(self, 0)

    @classmethod
    def stack(cls, layers: list[nn.Module], recipe: str = "block") -> tuple[FP8StackedLinear, ...]:
        """The stacked layers replacing ``layers`` (nn.Linear, quantized per ``recipe``, or
        FP8Linear of that recipe, copied bit for bit; all with a bias of one dtype or none): the
        first layer, then one member per further layer, on the first layer's device."""
        first = layers[0]
        if first.bias is not None:
            dtype = first.bias.dtype
        else:
            dtype = first.weight.dtype if first.weight.dtype in ACTIVATION_DTYPES else torch.bfloat16
        lead = cls(first.in_features, tuple(layer.out_features for layer in layers), first.bias is not None,
                   recipe, dtype, first.weight.device)
        with torch.no_grad():
            for index, layer in enumerate(layers):
                if type(layer) is FP8Linear:
                    q, scale = layer.weight, layer.weight_scale_inv
                else:
                    q, scale = quantize_weight(layer.weight, recipe)
                rows, scale_rows = lead._rows(index)
                lead.stacked_weight[rows].copy_(q)
                lead.stacked_weight_scale_inv[scale_rows].copy_(scale)
                if layer.bias is not None:
                    lead.stacked_bias[rows].copy_(layer.bias)
        lead.members = [FP8StackMember(lead, index) for index in range(1, len(layers))]
        return (lead, *lead.members)

    @classmethod
    def from_linear(cls, linear, recipe="block", dtype=None):
        raise TypeError(f"{cls.__name__} stacks several layers: build it with {cls.__name__}.stack([...])")

    def _rows(self, index: int) -> tuple[slice, slice]:
        """Rows of layer ``index`` in the stacked weight and in the stacked scales."""
        start = sum(self.out_sizes[:index])
        rows = slice(start, start + self.out_sizes[index])
        if self.recipe == "block":
            return rows, slice(rows.start // SCALE_BLOCK, rows.stop // SCALE_BLOCK)
        return rows, rows

    def _tie(self, layer: FP8Linear, index: int) -> None:
        rows, scale_rows = self._rows(index)
        layer._buffers["weight"] = self.stacked_weight[rows]
        layer._buffers["weight_scale_inv"] = self.stacked_weight_scale_inv[scale_rows]
        if self.stacked_bias is not None:
            # A buffer, not a Parameter: deepcopy clones a Parameter's data, but keeps a plain
            # tensor a view of the copied stack (the state-dict key is "bias" either way).
            layer._parameters.pop("bias", None)
            layer._buffers["bias"] = self.stacked_bias[rows]

    def _tie_all(self) -> None:
        self._tie(self, 0)
        for member in self.members:
            self._tie(member, member.index)

    def tied(self) -> bool:
        """Whether every layer's weight, scale and bias are still views of the stacked buffers."""
        layers = (self, *self.members)
        for index, layer in enumerate(layers):
            rows, scale_rows = self._rows(index)
            pairs = [(layer.weight, self.stacked_weight[rows]),
                     (layer.weight_scale_inv, self.stacked_weight_scale_inv[scale_rows])]
            if self.stacked_bias is not None:
                if layer.bias is None:
                    return False
                pairs.append((layer.bias, self.stacked_bias[rows]))
            for own, stacked in pairs:
                if own.device != stacked.device or own.data_ptr() != stacked.data_ptr() or own.shape != stacked.shape:
                    return False
        return True

    # ----------------------------------------------------------------------------- forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.check_input(x)
        y = self.quantized_mm(x, self.stacked_bias, self.stacked_weight, self.stacked_weight_scale_inv)
        parts = y.split(self.out_sizes, dim=-1)
        self.handoff.hold(x, list(parts[1:]))  # member i takes value i - 1
        return parts[0]

    # ---------------------------------------------------------------------- module plumbing

    def _apply(self, fn, recurse=True):
        """Device moves and dtype casts: the stacked buffers move once (the fp8 weight and fp32
        scales keep their dtypes, the bias is cast), every layer's views are re-derived from them."""
        _drop_views(self)
        self.handoff.clear()
        try:
            nn.Module._apply(self, keep_dtypes(fn, (self.stacked_weight, self.stacked_weight_scale_inv)), recurse)
        finally:
            self._tie_all()
        return self

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, stacked with {len(self.members)} more ({sum(self.out_sizes)} rows)"


class FP8StackMember(FP8Linear):
    """A later projection of a stack (see :class:`FP8StackedLinear`): its weight and scale are
    views of the first layer's stacked buffers. forward(x) returns the rows the first layer
    computed for this same x, or runs its own GEMM (another input, or x changed in place)."""

    def __init__(self, first: FP8StackedLinear, index: int):
        # No bias of its own (a biased stack ties a view of the stacked bias in): dtype unused.
        super().__init__(first.in_features, first.out_sizes[index], False, first.recipe, device="meta")
        self.index = index
        # Not a child module (the first layer is the parent's child already; the state dict
        # holds each projection once): a reference only.
        object.__setattr__(self, "first", first)
        first._tie(self, index)

    @classmethod
    def from_linear(cls, linear, recipe="block", dtype=None):
        raise TypeError(f"{cls.__name__} is a member of a stack: build the stack with FP8StackedLinear.stack([...])")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = self.first.handoff.take(x, self.index - 1)
        if rows is not None:
            return rows
        return super().forward(x)

    def _apply(self, fn, recurse=True):
        """The views are the first layer's business: re-derived from its buffers wherever they are
        now (if the first layer moves later, it re-ties this one again)."""
        _drop_views(self)
        try:
            nn.Module._apply(self, fn, recurse)
        finally:
            self.first._tie(self, self.index)
        return self

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, member {self.index} of a stack"


def _drop_views(layer: FP8Linear) -> None:
    """Unset a stacked layer's views before ``Module._apply`` (they are re-derived after it)."""
    for name in ("weight", "weight_scale_inv", "bias"):
        if name in layer._buffers:
            layer._buffers[name] = None


def _retie_after_load(parent: nn.Module, incompatible_keys, names: tuple[str, ...] = QKV) -> None:
    """After the parent's ``load_state_dict``: loads that copied into the views changed the
    stacked buffers already; ones that replaced the tensors (``assign=True``) did not, so the
    stacked buffers are rebuilt from the layers' tensors."""
    first = getattr(parent, names[0])
    if not isinstance(first, FP8StackedLinear) or first.tied():
        return
    layers = (first, *first.members)
    first.stacked_weight = torch.cat([layer.weight for layer in layers])
    first.stacked_weight_scale_inv = torch.cat([layer.weight_scale_inv for layer in layers]).float()
    if first.stacked_bias is not None:
        first.stacked_bias = torch.cat([layer.bias for layer in layers]).to(first.stacked_bias.dtype)
    first._tie_all()


def fuse_stacked_projections(model: nn.Module, skip=(), quantize: bool = True, recipe: str = "block",
                             names: tuple[str, ...] = QKV) -> nn.Module:
    """Replace (in place) the projections ``names`` of every module of ``model`` that
    :func:`stack_reason` accepts and none of whose projections' names match ``skip`` with
    stacked FP8 layers, and return the model. recipe: how nn.Linear projections are quantized
    (FP8Linear ones keep theirs). quantize: False stacks only modules whose projections are all
    FP8Linear already (a loaded FP8 checkpoint)."""
    from .convert import matches

    for name, parent in list(model.named_modules()):
        if stack_reason(parent, recipe, names) is not None:
            continue
        layers = [getattr(parent, n) for n in names]
        if not quantize and any(type(layer) is not FP8Linear for layer in layers):
            continue
        if any(matches(f"{name}.{n}" if name else n, skip) for n in names):
            continue
        for n, layer in zip(names, FP8StackedLinear.stack(layers, _stack_recipe(layers, recipe))):
            setattr(parent, n, layer)
        parent.register_load_state_dict_post_hook(functools.partial(_retie_after_load, names=names))
    return model
