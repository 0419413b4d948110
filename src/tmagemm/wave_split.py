"""Whole waves of native tiles, then the remaining columns as a GEMM of their own.

One row of 128-row tiles (96-128 tokens) over a weight whose 128-column tiles come to a little
more than a whole number of waves leaves most SMs idle in the last wave: 36864 columns are 288
tiles, 2.18 waves on 132 SMs, and the third wave runs 24 tiles on 24 SMs while the other 108
wait. This plan runs the columns of the whole waves on the native cooperative kernel's 128x128
tiles (each SM takes one tile per wave, so every SM streams the weight to the end) and plans the
remaining columns like any other problem: at 96-128 tokens and a few thousand columns the
dispatcher picks the tile or split-K kernel that spreads them over every SM. With programmatic
dependent launch the second kernel starts while the first drains. The two launches write
disjoint column ranges of ``out``; each reads the whole activation and its own columns of the
weight, the column scales and the bias.

Measured (graph-timed, L2 flushed, BENCHMARKS.md, 2026-11-26), per GEMM: at 96-128 tokens on
weights of 2.12-3.21 waves (35840-54272 columns, K = 2048-7168), 1.02-1.08x faster than the
single launch on an H100 and 1.05-1.20x on an H200 (fp8 with fast accumulation and tensor-wise
scales, and bf16; fp8 at K = 2048 and 112-128 tokens level, within 0.7%). At 72 tokens fp8 was
1.01-1.08x faster per GEMM but the DeepSeek-V3 decode stack gained nothing (0.3-0.9% slower),
and bf16 on the H200 was mixed (0.98-1.07x): the rule starts at 96 tokens. fp8 on weights of
1.45 and 1.70 waves (24576 x 1536, 28672 x 4096; H200, 128 tokens) ran 14-15% slower split this
way: the last wave must be short. Row-wise scales keep the single launch: per GEMM the split was 1% slower at 72 tokens (the
native tiles' row-wise epilogue costs them 3-8% there) and the Qwen2.5-7B decode stack 1-6%
slower per layer at 72-128 tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import device
from .plan import GemmArgs, Plan, Scaling, Variant

NAME = "mixed.wave_split"
TILE_N = 128  # columns per native tile (cuda.gemm.COOP_N128)
MIN_M = 96  # fewest tokens (72 gained per GEMM but not in the decode stacks)
MAX_M = 128  # one row of 128-row tiles
MIN_WAVES = 2  # whole waves of tiles before the last one (1.45 and 1.70 waves lost)
MAX_LAST_WAVE = 0.25  # the last wave's tiles as a share of the SMs (measured 0.12-0.24)


@dataclass(frozen=True)
class WaveSplitConfig:
    """``columns``: the leading output columns, whole waves of 128-column native tiles; the rest
    go to the dispatcher's plan for that slice."""

    columns: int


def lead_columns(m: int, n: int, ab_itemsize: int, sms: int) -> int:
    """The columns of the whole waves of 128x128 tiles, or 0 where this plan is not the measured
    choice (a pure function of the shape, the operand width and the SM count)."""
    if not MIN_M <= m <= MAX_M or ab_itemsize not in (1, 2):
        return 0
    waves, last = divmod(-(-n // TILE_N), sms)
    if waves < MIN_WAVES or last == 0 or last > MAX_LAST_WAVE * sms:
        return 0
    return waves * sms * TILE_N


def _columns_of(args: GemmArgs) -> int:
    return lead_columns(args.m, args.n, args.a.element_size(), device.sms_of(args.out.device))


def _slice(operands: tuple, start: int, stop: int) -> tuple:
    """The operands of output columns [start, stop): b's and out's columns, a column-wise scale
    and the bias sliced alike (the activation and its scale are shared). A column-wise scale
    comes as N values 4 bytes apart in any shape (a cached call passes the user's (1, N))."""
    a, b, out, scale_a, scale_b, bias = operands
    if scale_b is not None and scale_b.numel() != 1:
        scale_b = scale_b.reshape(-1)[start:stop]
    return (a, b[:, start:stop], out[:, start:stop], scale_a, scale_b, None if bias is None else bias[start:stop])


def _parts(args: GemmArgs, columns: int) -> tuple[GemmArgs, GemmArgs]:
    def part(start: int, stop: int) -> GemmArgs:
        return GemmArgs(*_slice(args.operands, start, stop), fast_accum=args.fast_accum)

    return part(0, columns), part(columns, args.n)


def refusal(args: GemmArgs) -> str | None:
    """Why this plan is not the measured choice for ``args`` (None where it is): the dispatcher's
    rule, without the native kernel's own checks."""
    if args.block_scaling is not None:
        return "block-scaled products take the block-scaled kernels"
    if args.is_fp8 and not args.fast_accum:
        return "fp8 without fast accumulation: not measured split this way"
    if Scaling.ROW in args.scaling:
        return ("row-wise scales: the split was slower on the Qwen2.5-7B decode stack (1-6% per layer, "
                "BENCHMARKS.md 2026-11-26)")
    if not _columns_of(args):
        return (f"M={args.m}, N={args.n}: not one row of 128-row tiles whose 128-column tiles make "
                f"at least {MIN_WAVES} whole waves and a last wave of at most {MAX_LAST_WAVE:.0%} of the SMs")
    return None


def supports(args: GemmArgs) -> str | None:
    reason = refusal(args)
    if reason is not None:
        return reason
    from .cuda.gemm import COOP_N128, unsupported_reason  # a backend module: imported lazily

    return unsupported_reason(_parts(args, _columns_of(args))[0], COOP_N128)


def build(args: GemmArgs, config: WaveSplitConfig | None = None) -> Plan:
    from . import plan
    from .cuda.gemm import COOP_N128

    config = config or WaveSplitConfig(_columns_of(args))
    if not 0 < config.columns < args.n or config.columns % TILE_N:
        raise ValueError(f"{NAME}: columns must be a multiple of {TILE_N} in (0, N={args.n}), got {config.columns}")
    lead_args, rest_args = _parts(args, config.columns)
    lead = plan.build(lead_args, variant="cuda.persistent_coop", config=COOP_N128)
    rest = plan.build(rest_args)  # the dispatcher's pick for the remaining columns
    columns, n = config.columns, args.n

    def launch(a, b, out, scale_a, scale_b, bias) -> None:
        # The lead's columns start at the full operands' addresses, and a native launch reads only
        # the operands' addresses (its tensor maps and grid come from the plan's slice): the full
        # tensors serve, and only the rest is sliced (two views, ~3 us of host time per call).
        lead.launch(a, b, out, scale_a, scale_b, bias)
        rest.launch(*_slice((a, b, out, scale_a, scale_b, bias), columns, n))

    return Plan(NAME, config, launch, lead.device_index, direct=lead.direct and rest.direct)


VARIANTS = [
    Variant(
        name=NAME,
        backend="mixed",
        description="whole waves of native 128x128 tiles, then the remaining columns as their own GEMM "
        "(one row of tiles on weights a little over 2+ waves wide)",
        supports=supports,
        build=build,
    ),
]
