"""The ``tmagemm`` command line: argument errors, report, inspect, env and the CPU bench check."""

import json
from pathlib import Path

import pytest

from tmagemm import cli

SAMPLE = Path(__file__).parent / "data" / "bench_sample" / "results.json"


@pytest.mark.parametrize("argv", [
    ["bench", "--m", "1,x"],
    ["bench", "--m", "-4"],
    ["bench", "--dtype", "fp4"],
    ["bench", "--preset", "tiny"],
    ["inspect", "triton.tma", "--config", "block_m"],
    [],
])
def test_argparse_errors_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    assert "error" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["bench", "--check", "--dtype", "bf16"], "bf16 needs a GPU"),
    (["bench", "--check", "--preset", "sweep", "--n", "64"], "custom shapes"),
    (["bench", "--check", "--m", "4", "--n", "64"], "--k"),
    (["bench", "--check", "--providers", "cublsa"], "matches none"),
    (["report", "/nonexistent/results.json"], "no benchmark result"),
    (["inspect"], "exactly one"),
    (["inspect", "triton.tma", "--cu", "gemm_sm90_ws.cu"], "exactly one"),
    (["inspect", "triton.nope"], "unknown tmagemm variant"),
    (["inspect", "triton.tma", "-D", "X=1"], "-D applies"),
])
def test_semantic_errors_return_2_with_a_message(argv, message, capsys, tmp_path):
    assert cli.main([*argv, *(["--out", str(tmp_path)] if argv[0] != "report" else [])]) == 2
    err = capsys.readouterr().err
    assert message in err, err


def test_report_renders_and_plots(tmp_path, capsys):
    assert cli.main(["report", str(SAMPLE), "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "Geometric means" in out and "tmagemm.auto" in out and "cublas.fp8.exact" in out
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["roofline.png", "speedup.png", "tflops.png"]


def test_bench_check_on_cpu_writes_results(tmp_path, capsys):
    code = cli.main(["bench", "--check", "--dtype", "fp16", "--m", "17", "--n", "80", "--k", "96",
                     "--providers", "triton.tma,triton.ptr", "--out", str(tmp_path)])
    assert code == 0
    captured = capsys.readouterr()
    assert "timings need a GPU" in captured.err
    payload = json.loads((tmp_path / "results.json").read_text())
    assert [(r["provider"], r["status"]) for r in payload["records"]] == [("triton.tma", "checked"), ("triton.ptr", "checked")]
    assert (tmp_path / "table.txt").read_text().count("checked") == 2


def test_inspect_writes_dumps_and_json(tmp_path, capsys):
    assert cli.main(["inspect", "triton.tma", "--dtype", "fp16", "--json", "--out", str(tmp_path)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["load path"] == "TMA" and summary["sass HGMMA"] > 0
    assert {Path(p).suffix for p in summary["files"].values()} == {".ptx", ".cubin", ".sass"}
    assert all(Path(p).stat().st_size > 0 for p in summary["files"].values())


def test_inspect_list_and_env(capsys):
    assert cli.main(["inspect", "--list"]) == 0
    listing = capsys.readouterr().out
    assert "triton.tma" in listing and "[triton]" in listing
    assert cli.main(["env"]) == 0
    env = capsys.readouterr().out
    for needle in ("torch", "triton", "Hopper GPU (TMA + WGMMA)", "Triton TMA kernels", "native CUDA kernels"):
        assert needle in env
