"""Config selection (tmagemm.tuning.pick): the fastest candidate must still beat the heuristic
when the two are re-timed in alternation, so one noisy pass cannot replace a good heuristic."""

import itertools

from tmagemm import tuning
from tmagemm.configs import TritonGemmConfig

HEUR = TritonGemmConfig(block_m=64, block_n=64, block_k=256, group_m=8, num_stages=6, num_warps=4)
FAST = TritonGemmConfig(block_m=64, block_n=32, block_k=256, group_m=8, num_stages=6, num_warps=4)
BIG = TritonGemmConfig(block_m=128, block_n=256, block_k=128, group_m=8, num_stages=3, num_warps=8)


def _clock(times):
    """time_ms that returns, per config, the next value of its sequence; records the call order."""
    seqs = {c: iter(v) for c, v in times.items()}
    calls = []

    def time_ms(config):
        calls.append(config)
        return next(seqs[config])

    return time_ms, calls


def test_a_one_pass_win_that_does_not_repeat_keeps_the_heuristic():
    # The heuristic read slow once (cold clocks); re-timed in alternation it is the faster one.
    time_ms, calls = _clock({HEUR: [15.0, 12.0, 12.1, 11.9], BIG: [12.5, 13.8, 13.9, 14.0], FAST: [14.0]})
    assert tuning.pick(HEUR, [HEUR, BIG, FAST], time_ms) == HEUR
    assert calls[3:] == [HEUR, BIG] * 3, "confirmation alternates the two"


def test_a_clear_win_replaces_the_heuristic():
    time_ms, _ = _clock({HEUR: [12.0, 12.0, 12.1, 11.9], FAST: [10.0, 10.5, 10.4, 10.6]})
    assert tuning.pick(HEUR, [HEUR, FAST], time_ms) == FAST


def test_a_win_below_the_margin_keeps_the_heuristic():
    time_ms, _ = _clock({HEUR: [12.0] * 4, FAST: [11.9] * 4})  # 0.8% faster: noise
    assert tuning.pick(HEUR, [HEUR, FAST], time_ms) == HEUR


def test_configs_that_cannot_run_are_skipped():
    time_ms, _ = _clock({HEUR: itertools.repeat(None), FAST: [11.0], BIG: [12.0]})
    assert tuning.pick(HEUR, [HEUR, FAST, BIG], time_ms) == FAST  # nothing to confirm against
    time_ms, _ = _clock({HEUR: itertools.repeat(None), FAST: itertools.repeat(None)})
    assert tuning.pick(HEUR, [HEUR, FAST], time_ms) == HEUR


def test_the_heuristic_winning_the_pass_is_kept_without_more_timing():
    time_ms, calls = _clock({HEUR: [10.0], FAST: [11.0]})
    assert tuning.pick(HEUR, [HEUR, FAST], time_ms) == HEUR
    assert len(calls) == 2


def test_pick_reports_the_times_it_compared():
    timings = {}
    time_ms, _ = _clock({HEUR: [12.0, 12.0, 12.1, 11.9], FAST: [10.0, 10.5, 10.4, 10.6]})
    assert tuning.pick(HEUR, [HEUR, FAST], time_ms, timings) == FAST
    assert timings == {"heuristic": 12.0, "chosen": 10.5}
    timings = {}
    time_ms, _ = _clock({HEUR: [12.0] * 4, FAST: [11.9] * 4})
    assert tuning.pick(HEUR, [HEUR, FAST], time_ms, timings) == HEUR
    assert timings["chosen"] == timings["heuristic"] == 12.0


def test_call_time_tuning_is_off_by_default(monkeypatch):
    from tmagemm import envs

    monkeypatch.delenv("TMAGEMM_AUTOTUNE", raising=False)
    assert not envs.autotune_enabled()
    monkeypatch.setenv("TMAGEMM_AUTOTUNE", "1")
    assert envs.autotune_enabled()
    monkeypatch.setenv("TMAGEMM_AUTOTUNE", "0")
    assert not envs.autotune_enabled()
