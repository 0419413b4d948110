"""RMSNorm fused with the FP8 layers' input quantization: the norm in front of an attention's
projections or an MLP writes its output and, in the same kernel, that output's fp8 values and
scales, which the layers it feeds take instead of quantizing it again.

In a decode step every norm is a string of small kernels (transformers' RMSNorm: a cast, a
square, a mean, an rsqrt, two products, a cast) and each FP8 layer it feeds starts with a
quantizer. :class:`FP8RMSNorm` is one kernel for both
(:func:`tmagemm.triton.norm_quantize.rms_norm_quantize`).

Hand-off. The norm keeps its output's quantization for the layers linked to it (its consumers:
an attention's q/k/v projections or their stack, an MLP's gate/up projections or its
:class:`~tmagemm.nn.FP8GatedMLP`). A linked layer called with that very tensor, unchanged since
(its version counter), takes the quantization; called with anything else it quantizes its input
itself. The fp8 values are bit for bit what the layer would compute from the norm's output, so
results never depend on whether the model calls its modules as the linking assumed. Once every
linked layer has taken it, the norm holds nothing; under ``torch.compile`` the hand-off is
resolved while tracing, so the graph holds no quantizer for those layers.

Linking (:func:`fuse_norms`): a module whose forward assigns ``v = self.<norm>(...)`` and, in the
next statement, calls ``self.<child>(v)`` (or ``self.<child>(hidden_states=v, ...)``) links the
norm to the FP8 layers of that child that quantize its input (:func:`quantizing_layers`): a
transformers decoder layer's ``input_layernorm`` -> ``self_attn``'s q/k/v and
``post_attention_layernorm`` -> ``mlp``. The norm must compute transformers' RMSNorm
(:func:`rms_norm_reason`).
"""

from __future__ import annotations

import ast
import functools

import torch
from torch import nn

from ..triton.norm_quantize import MAX_HIDDEN, valid_eps
from .handoff import Handoff
from .linear import ACTIVATION_DTYPES, ALIGN, FP8Linear, as_rows, check_input
from .mlp import FP8GatedMLP
from .quantize import activation_ops
from .source import forward_def, self_call, statements
from .stacked import QKV, FP8StackedLinear, calls_on_one_input

GATE_UP = ("gate_proj", "up_proj")
RECIPES = ("block", "row")  # a tensor-wise scale needs every row's amax: not one program's work

# transformers' RMSNorm forward (LlamaRMSNorm; Qwen2, Qwen3, Mistral and others copy it).
_RMS_NORM = """
def forward(self, hidden_states):
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return self.weight * hidden_states.to(input_dtype)
"""


@functools.lru_cache(maxsize=None)
def has_rms_norm_forward(cls: type) -> bool:
    """Whether ``cls.forward(self, hidden_states)`` is transformers' RMSNorm, statement for
    statement (read from its source; False where there is none)."""
    fn = forward_def(cls)
    want = ast.parse(_RMS_NORM).body[0]
    return (fn is not None and [a.arg for a in fn.args.args] == ["self", "hidden_states"]
            and not fn.args.vararg and not fn.args.kwarg
            and [ast.dump(s) for s in statements(fn)] == [ast.dump(s) for s in statements(want)])


def _valid_hidden(size) -> bool:
    """A positive int, a multiple of 16 (the FP8 layers' rows), at most MAX_HIDDEN (one row per program)."""
    return not isinstance(size, bool) and isinstance(size, int) and 0 < size <= MAX_HIDDEN and size % ALIGN == 0


def rms_norm_reason(norm: nn.Module) -> str | None:
    """None when :class:`FP8RMSNorm` can replace ``norm``, else why not: transformers' RMSNorm
    (:func:`has_rms_norm_forward`) with a 1-D ``weight`` of bfloat16, float16 or float32, a
    multiple of 16 and at most MAX_HIDDEN long, and a numeric ``variance_epsilon``."""
    if isinstance(norm, FP8RMSNorm):
        return "already an FP8RMSNorm"
    if not has_rms_norm_forward(type(norm)):
        return f"{type(norm).__name__}.forward is not transformers' RMSNorm (LlamaRMSNorm's formula)"
    weight, eps = getattr(norm, "weight", None), getattr(norm, "variance_epsilon", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1:
        return f"{type(norm).__name__} has no 1-D weight"
    if weight.dtype not in ACTIVATION_DTYPES:
        return f"its weight has dtype {weight.dtype}, not bfloat16, float16 or float32"
    if not _valid_hidden(weight.shape[0]):
        return f"hidden size {weight.shape[0]} is not a multiple of {ALIGN} up to {MAX_HIDDEN}"
    if not valid_eps(eps):
        return f"variance_epsilon is {eps!r}, not a non-negative number"
    return None


@functools.lru_cache(maxsize=None)
def norm_feeds(cls: type) -> tuple[tuple[str, str], ...]:
    """(norm, consumer) child names from ``cls.forward``: a statement ``v = self.<norm>(u)``
    whose next statement calls ``self.<consumer>`` with ``v`` as an argument (read from its
    source; empty where there is none)."""
    fn = forward_def(cls)
    if fn is None:
        return ()
    pairs = []
    for stmt, following in zip(fn.body, fn.body[1:]):
        if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)):
            continue
        norm = self_call(stmt.value)
        if norm is None or len(norm[1]) != 1:
            continue
        variable = stmt.targets[0].id
        for node in ast.walk(following):
            call = self_call(node)
            if call and any(isinstance(a, ast.Name) and a.id == variable for a in call[1]):
                pairs.append((norm[0], call[0]))
                break
    return tuple(pairs)


def quantizing_layers(module: nn.Module) -> list[nn.Module]:
    """The FP8 layers that quantize ``module``'s input: the module itself if it is an FP8Linear
    (exact type, or the first layer of a stack) or an FP8GatedMLP; else, where its forward calls
    q/k/v (or gate/up) in order on one input (:func:`~tmagemm.nn.stacked.calls_on_one_input`),
    their stack's first layer or the FP8Linear projections; else none."""
    if type(module) in (FP8Linear, FP8StackedLinear, FP8GatedMLP):
        return [module]
    for names in (QKV, GATE_UP):
        layers = [getattr(module, n, None) for n in names]
        if not all(isinstance(layer, nn.Module) for layer in layers) or not calls_on_one_input(type(module), names):
            continue
        if type(layers[0]) is FP8StackedLinear:
            return [layers[0]]  # the stack's other members take their rows from it
        if all(type(layer) is FP8Linear for layer in layers):
            return layers
    return []


def _input_recipe(layer: nn.Module) -> str:
    return "block" if isinstance(layer, FP8GatedMLP) else layer.recipe


def _input_width(layer: nn.Module) -> int:
    return layer.hidden_size if isinstance(layer, FP8GatedMLP) else layer.in_features


class FP8RMSNorm(nn.Module):
    """transformers' RMSNorm, ``weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)``, that also
    quantizes its output for the FP8 layers it feeds (see the module docstring), in one kernel.

    hidden_size: a multiple of 16. eps: ``variance_epsilon``. recipe: the linked layers'
    activation recipe, "block" (1x128 groups) or "row". dtype: the weight's (bfloat16, float16
    or float32). The state dict holds ``weight`` only (transformers' name).

    forward(x): x (..., hidden_size) bfloat16, float16 or float32 -> the norm, of dtype
    ``torch.promote_types(weight.dtype, x.dtype)``; FP8Linear's checks and errors (CUDA tensors
    on a Hopper GPU; the CPU under TRITON_INTERPRET=1). No host synchronisation; traces under
    torch.compile(fullgraph=True). Inference only (no gradients).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, recipe: str = "block", dtype: torch.dtype = torch.bfloat16,
                 device=None):
        super().__init__()
        name = type(self).__name__
        if not _valid_hidden(hidden_size):
            raise ValueError(f"{name}: hidden_size must be a positive multiple of {ALIGN} up to {MAX_HIDDEN}, "
                             f"got {hidden_size!r}")
        if not valid_eps(eps):
            raise ValueError(f"{name}: eps must be a non-negative number, got {eps!r}")
        if recipe not in RECIPES:
            raise ValueError(f"{name}: recipe must be one of {', '.join(repr(r) for r in RECIPES)}, got {recipe!r}")
        if dtype not in ACTIVATION_DTYPES:
            raise TypeError(f"{name}: dtype must be torch.bfloat16, torch.float16 or torch.float32, got {dtype}")
        self.hidden_size, self.variance_epsilon, self.recipe = hidden_size, float(eps), recipe
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device), requires_grad=False)
        self.consumers = 0  # linked layers that take each output's quantization (set by link)
        self.handoff = Handoff()  # (y_fp8, scale) of the last forward's y, once per linked layer

    @classmethod
    def from_norm(cls, norm: nn.Module, recipe: str = "block") -> FP8RMSNorm:
        """An FP8RMSNorm computing ``norm`` (see :func:`rms_norm_reason`; ValueError otherwise),
        its weight copied, on its device."""
        reason = rms_norm_reason(norm)
        if reason:
            raise ValueError(f"{cls.__name__}.from_norm: {reason}")
        weight = norm.weight
        fused = cls(weight.shape[0], norm.variance_epsilon, recipe, weight.dtype, weight.device)
        with torch.no_grad():
            fused.weight.copy_(weight)
        return fused

    def link_reason(self, layers: list[nn.Module]) -> str | None:
        """None when :meth:`link` takes ``layers``, else why not: each an FP8Linear or FP8GatedMLP
        taking this recipe's activations of this width, not linked to a norm yet."""
        for layer in layers:
            if not isinstance(layer, (FP8Linear, FP8GatedMLP)) or _input_recipe(layer) != self.recipe \
                    or _input_width(layer) != self.hidden_size:
                return f"{layer!r} does not take {self.recipe!r} activations of width {self.hidden_size}"
            if layer.input_norm is not None:
                return f"{type(layer).__name__} is linked to a norm already"
        return None

    def link(self, layers: list[nn.Module]) -> None:
        """Make ``layers`` take this norm's quantized output (ValueError where :meth:`link_reason`
        says why not)."""
        reason = self.link_reason(layers)
        if reason:
            raise ValueError(f"{type(self).__name__}.link: {reason}")
        for layer in layers:
            object.__setattr__(layer, "input_norm", self)  # a reference: the layer is not this norm's child
        self.consumers += len(layers)

    # ----------------------------------------------------------------------------- forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_input(x, self.hidden_size, type(self).__name__)
        y, q, scale = activation_ops().rms_norm_quantize_activation(as_rows(x, self.hidden_size), self.weight,
                                                                         self.variance_epsilon, self.recipe)
        y = y.reshape(x.shape)
        if self.consumers:
            self.handoff.hold(y, [(q, scale)] * self.consumers)
        return y

    def _apply(self, fn, recurse=True):
        self.handoff.clear()  # a device move or cast leaves no quantization of the old tensors
        return super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        return (f"{self.hidden_size}, eps={self.variance_epsilon}, recipe={self.recipe!r}, "
                f"quantizes for {self.consumers} layer{'s' if self.consumers != 1 else ''}")


def fuse_norms(model: nn.Module, skip=()) -> nn.Module:
    """Replace (in place) every norm that a module's forward feeds to FP8 layers
    (:func:`norm_feeds`, :func:`quantizing_layers`; all of one recipe, "block" or "row", and of the
    norm's width, none linked yet) and that :func:`rms_norm_reason` accepts with an
    :class:`FP8RMSNorm` linked to those layers, and return the model. skip: names or patterns
    (``convert``'s rules) of norms to keep."""
    from .convert import matches

    for name, parent in list(model.named_modules()):
        for norm_name, consumer_name in norm_feeds(type(parent)):
            norm, consumer = getattr(parent, norm_name, None), getattr(parent, consumer_name, None)
            if not isinstance(norm, nn.Module) or not isinstance(consumer, nn.Module) or rms_norm_reason(norm):
                continue
            if matches(f"{name}.{norm_name}" if name else norm_name, skip):
                continue
            layers = quantizing_layers(consumer)
            recipes = {_input_recipe(layer) for layer in layers}
            if len(recipes) != 1 or not recipes <= set(RECIPES):
                continue
            fused = FP8RMSNorm.from_norm(norm, recipes.pop())
            if fused.link_reason(layers) is None:
                fused.link(layers)
                setattr(parent, norm_name, fused)
    return model
