"""The ``tmagemm`` command line: argument errors, report, inspect, env and the CPU bench check."""

import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

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
    # Options the interpreter check cannot honour are refused by name, never silently dropped.
    (["bench", "--check", "--preset", "llm"], "--preset llm needs a GPU"),
    (["bench", "--check", "--preset", "sweep"], "--preset sweep needs a GPU"),
    (["bench", "--check", "--preset", "tma"], "--preset tma needs a GPU"),
    (["bench", "--check", "--graph"], "--graph needs a GPU"),
    (["bench", "--check", "--budget-ms", "50"], "--budget-ms needs a GPU"),
    (["bench", "--check", "--dtype", "fp16", "--rowwise"], "--rowwise applies to fp8 runs only"),
    (["bench", "--dtype", "fp16", "--exact-accum"], "--exact-accum applies to fp8 runs only"),
    (["report", "/nonexistent/results.json"], "no benchmark result"),
    (["inspect"], "exactly one"),
    (["inspect", "triton.tma", "--cu", "gemm_sm90_warp_specialized.cu"], "exactly one"),
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


def test_bench_check_names_the_dtypes_it_checks_when_providers_match_nothing(capsys, tmp_path):
    # No --dtype: the interpreter check runs fp16 and fp8, and the message must say both.
    assert cli.main(["bench", "--check", "--providers", "cuda.*", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "for fp16 and fp8" in err and "cuda.warp_specialized" in err and "need a GPU" in err, err
    assert cli.main(["bench", "--check", "--dtype", "fp8", "--providers", "cuda.*", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "for fp8 " in err and "fp16" not in err, err


@pytest.mark.parametrize("argv, folder, dtypes", [
    (["--providers", "triton.tma"], "check-small-fp16+fp8", {"fp16", "fp8"}),
    (["--providers", "triton.ptr", "--dtype", "fp8", "--m", "3", "--n", "64", "--k", "64"],
     "check-custom-fp8", {"fp8"}),
])
def test_bench_check_default_folder_names_what_ran(argv, folder, dtypes, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["bench", "--check", *argv]) == 0
    capsys.readouterr()
    (made,) = (tmp_path / "results").iterdir()
    assert re.fullmatch(r"\d{8}-\d{6}-" + re.escape(folder), made.name), made.name
    records = json.loads((made / "results.json").read_text())["records"]
    assert {r["dtype"] for r in records} == dtypes


def test_bench_check_honours_rowwise_and_exact_accum(tmp_path, capsys):
    code = cli.main(["bench", "--check", "--dtype", "fp8", "--rowwise", "--exact-accum", "--m", "5", "--n", "64",
                     "--k", "64", "--providers", "triton.tma", "--out", str(tmp_path)])
    assert code == 0
    payload = json.loads((tmp_path / "results.json").read_text())
    config = payload["metadata"]["config"]
    assert (config["rowwise"], config["fast_accum"], config["dtypes"]) == (True, False, ["fp8"])
    assert [r["status"] for r in payload["records"]] == ["checked"]


def test_tma_preset_refuses_gemm_options(monkeypatch, capsys, tmp_path):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the GPU path; refused before any GPU work
    assert cli.main(["bench", "--preset", "tma", "--graph", "--dtype", "fp8", "--out", str(tmp_path)]) == 2
    assert "--dtype, --graph do not apply" in capsys.readouterr().err


def test_bench_help_says_which_options_need_a_gpu(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "without a GPU: fp16 and fp8" in text
    assert "--preset, --graph and --budget-ms are refused" in text
    assert "results/<date>-check-<shapes>-<dtypes>" in text
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert "without a GPU: check the Triton kernels" in " ".join(capsys.readouterr().out.split())


def _listing_columns(listing):
    rows = [line for line in listing.splitlines() if line.strip()]
    return rows, {line.index("[") for line in rows if "[" in line}


def test_inspect_list_columns_fit_the_longest_name(monkeypatch, capsys):
    assert cli.main(["inspect", "--list"]) == 0
    rows, starts = _listing_columns(capsys.readouterr().out)
    assert len(starts) == 1, rows  # every backend column starts at one place
    from tmagemm import plan

    long = "cuda." + "x" * 40
    fake = [SimpleNamespace(name="a", backend="triton", description="short one"),
            SimpleNamespace(name=long, backend="cuda", description="long one")]
    monkeypatch.setattr(plan, "variants", lambda: fake)
    monkeypatch.setattr(plan, "unavailable", lambda: {"tmagemm.some_module_with_a_long_name": "ImportError: x"})
    assert cli.main(["inspect", "--list"]) == 0
    rows, starts = _listing_columns(capsys.readouterr().out)
    assert starts == {len(long) + 2}, rows
    text_column = len(long) + 2 + len("[triton]") + 2
    assert {line.index(text) for line, text in zip(rows, ("short one", "long one"))} == {text_column}
    assert rows[2].startswith("tmagemm.some_module_with_a_long_name") and "not importable: ImportError: x" in rows[2]


FP_FUSION_TEXT = ("TRITON_DEFAULT_FP_FUSION is unset: defaulting to FP fusion ENABLED for backward compatibility "
                  "in Triton 3.9.")


def test_inspect_hides_the_fp_fusion_notice_and_nothing_else(monkeypatch, tmp_path, capsys):
    from tmagemm import inspection

    def fake_inspect(name, dtype, config):
        warnings.warn(FP_FUSION_TEXT, UserWarning)
        warnings.warn("the kernel spills registers", UserWarning)
        return inspection.Artifacts("fake", "", b"", "", None, None, None)

    monkeypatch.setattr(inspection, "inspect_variant", fake_inspect)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert cli.main(["inspect", "triton.tma", "--out", str(tmp_path)]) == 0
    assert [str(w.message) for w in seen] == ["the kernel spills registers"]
    capsys.readouterr()


def test_inspect_command_prints_no_fp_fusion_notice(tmp_path):
    # A fresh process (Triton warns once per process), compiling in-process as a user's shell does.
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TRITON_DEFAULT_FP_FUSION")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    proc = subprocess.run([sys.executable, "-m", "tmagemm.cli", "inspect", "triton.ptr", "--dtype", "fp16",
                           "--out", str(tmp_path)], env=env, capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "load path" in proc.stdout
    assert "FP_FUSION" not in proc.stderr, proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU-less refusal")
@pytest.mark.parametrize("command", ["warmup", "tune"])
def test_warmup_and_tune_refuse_without_a_gpu(command, capsys):
    assert cli.main([command, "--shapes", "4096x4096"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.parametrize("shapes", ["4096", "4096x", "0x64", "axb"])
def test_warmup_shapes_must_be_n_by_k(shapes, capsys):
    with pytest.raises(SystemExit):
        cli.main(["warmup", "--shapes", shapes])
    assert "NxK" in capsys.readouterr().err
