"""The `xpress` command in-process: `xpress demo` (the main command, end to end at --tiny size) and
`xpress bench` (the synthetic latency check) on tiny heads: reports, checks, and refusals of nonsense."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
import subprocess
import sys

import jax
import pytest

import xpress_jax as xj
from xpress_jax import cli

TINY = ["--vocab", "97", "--hidden", "16", "--block", "5", "--rank", "8", "--mlp", "8", "--n", "2", "--reps", "1"]


def run(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# slow: the synthetic head's bench runs fast in test_bench_default_topc_is_clamped_to_a_small_vocab
@pytest.mark.parametrize("backend", [pytest.param("xla", marks=pytest.mark.slow),
                                     pytest.param("pallas", marks=pytest.mark.slow)])
def test_bench_tiny_runs_both_modes_and_checks(capsys, backend):
    code, out, err = run(capsys, "bench", *TINY, "--topc", "11", "--passes", "3", "--backend", backend)
    assert code == 0, err
    assert "full-vocab" in out and "top-11" in out and "compile+1st s" in out
    assert "fixed point" in out and "identical" in out
    assert out.strip().endswith("OK")
    assert "compile + first call" in err  # progress on stderr, the report on stdout
    if backend == "pallas":  # interpret mode off a GPU; compiled kernels on one
        assert ("(interpret mode)" in out) == (jax.default_backend() != "gpu")


@pytest.mark.slow
def test_bench_default_topc_is_clamped_to_a_small_vocab(capsys):
    # `xpress bench --vocab 100` (then `xpress demo`) used to fail: the default C=512 exceeded V.
    code, out, err = run(capsys, "bench", *TINY, "--passes", "2", "-q")
    assert code == 0, err
    assert "C=97" in out and "top-97" in out
    assert err == ""  # --quiet


@pytest.mark.parametrize(
    "argv,option",
    [
        (["--n", "0"], "--n"),
        (["--n", "-3"], "--n"),
        (["--reps", "0"], "--reps"),
        (["--vocab", "0"], "--vocab"),
        (["--block", "1"], "--block"),
        (["--hidden", "-1"], "--hidden"),
        (["--rank", "0"], "--rank"),
        (["--mlp", "0"], "--mlp"),
        (["--passes", "0"], "--passes"),
        (["--topc", "-1"], "--topc"),
        (["--topc", "98"], "--topc"),  # explicit C > V (97)
        (["--std", "0"], "--std"),
        (["--std", "nan"], "--std"),
        (["--seed", "-1"], "--seed"),
        (["--n", "x"], "--n"),
        (["--backend", "cuda"], "--backend"),
    ],
)
def test_bench_refuses_nonsense_with_exit_2_naming_the_option(capsys, argv, option):
    code, out, err = run(capsys, "bench", *TINY, *argv)
    assert code == 2, (out, err)
    assert option in err.splitlines()[-1], err
    assert "Traceback" not in err and out == ""


def test_help_shows_every_option_with_help_and_default(capsys):
    assert cli.main(["bench", "--help"]) == 0
    text = capsys.readouterr().out
    parser = cli.build_parser()
    bench = parser._subparsers._group_actions[0].choices["bench"]
    for action in bench._actions:
        assert action.help, f"{action.option_strings} has no help"
        if action.option_strings and action.option_strings[0] not in ("-h", "-q"):
            helptext = " ".join(action.help.split())
            assert "default" in helptext or action.default is not None, action.option_strings
    assert "(default: 4)" in text and "(default: 5)" in text and "default: 32000" in text


def test_main_help_names_the_converter(capsys):
    assert cli.main(["--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "xpress-convert" in text and "demo" in text and "bench" in text


def test_version(capsys):
    assert cli.main(["--version"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"xpress-jax {xj.__version__} (jax {jax.__version__}")


def test_version_matches_pyproject():
    import tomllib
    from pathlib import Path

    meta = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    assert meta["project"]["version"] == xj.__version__


@pytest.mark.slow
def test_bench_on_a_converted_checkpoint(tmp_path, capsys):
    cfg = xj.HeadConfig(vocab_size=61, hidden_size=12, block_size=5, rank=8, mlp_hidden=8, topc=7, num_passes=3,
                        max_num_reqs=4)
    path = xj.save_params(tmp_path / "head", xj.init_head(cfg, jax.random.key(0), std=0.3))
    code, out, err = run(capsys, "bench", "--checkpoint", str(path), "--n", "2", "--reps", "1")
    assert code == 0, err
    assert f"checkpoint {path}" in out and "V=61" in out and "C=7 K=3" in out and "top-7" in out
    assert out.strip().endswith("OK")
    # Same sizes as the checkpoint: fine. Other sizes, --std, N above max_num_reqs: refused, naming the option.
    args = cli.build_parser().parse_args(["bench", "--checkpoint", str(path), "--vocab", "61", "--topc", "5"])
    assert cli._resolve(args, pytest.fail)[0] == dataclasses.replace(cfg, topc=5)
    for argv, option in ((["--vocab", "62"], "--vocab 62"), (["--std", "0.1"], "--std"), (["--n", "5"], "--n 5"),
                         (["--topc", "62"], "--topc 62")):
        code, out, err = run(capsys, "bench", "--checkpoint", str(path), *argv)
        assert code == 2 and option in err, (argv, err)
    code, out, err = run(capsys, "bench", "--checkpoint", str(tmp_path / "nope"))
    assert code == 2 and "--checkpoint" in err and "no checkpoint" in err


@pytest.mark.slow
def test_a_failed_check_exits_1(capsys, monkeypatch):
    real = xj.refine

    def broken(head, *a, num_passes=None, **kw):  # more passes change tokens: the fixed point breaks
        out = real(head, *a, num_passes=num_passes, **kw)
        return out + (num_passes == head.config.block_size if num_passes else 0)

    monkeypatch.setattr(xj, "refine", broken)
    code, out, err = run(capsys, "bench", *TINY, "--topc", "0", "-q")
    assert code == 1 and "DIFFERENT" in out and out.strip().endswith("FAILED")


@pytest.mark.slow
def test_console_entry_point_exits_with_mains_code():
    """The one subprocess check: `python -m xpress_jax.cli` exits with main's code (2 on usage)."""
    res = subprocess.run([sys.executable, "-m", "xpress_jax.cli", "bench", "--n", "0"], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 2 and "--n" in res.stderr


# ---------------------------------------------------------------- xpress demo (the main command)
def _demo_tiny(tmp_path, capsys):
    out_dir = tmp_path / "out"
    code, out, err = run(capsys, "demo", "--tiny", "--out", str(out_dir))
    assert code == 0, err
    return out_dir, out, err


@pytest.mark.slow
def test_demo_tiny_runs_end_to_end(tmp_path, capsys):
    out_dir, out, err = _demo_tiny(tmp_path, capsys)
    assert out.strip().endswith("OK")
    # A smoke run says so and shows no ratio as if it were a result.
    assert "smoke run (--tiny)" in out and "These numbers are no result" in out
    assert not re.search(r"\d\.\d\dx", out) and "for the drafter alone" not in out
    assert "100.00%" in out and "bitwise identical to the Orbax export" in out  # convert --verify, both exports
    assert re.search(r"train : 40 steps in \d+(\.\d+)? (ms|s) after compile", out) and "in 0.0 s" not in out
    assert "train " in err and "training" in err  # progress on stderr
    for name in ("train_state", "head_orbax", "vllm_head", "converted", "results.json"):
        assert (out_dir / name).exists(), name
    if importlib.util.find_spec("matplotlib"):
        assert (out_dir / "accepted_length.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:  # a dependency, but a venv may lack it: the run says so instead of failing
        assert "plot  : skipped (matplotlib is not installed" in out
    res = json.loads((out_dir / "results.json").read_text())
    acc = res["accepted_length"]
    B = res["task"]["block_size"]
    assert set(acc["refined"]) == {"0", "4"} and all(len(row) == B - 1 for row in acc["refined"].values())
    # The printed table is the measured numbers: row K=0 is the drafter, row K=k the refined k passes.
    rows = {int(line.split()[0]): line.split()[1:3] for line in out.splitlines()
            if re.match(r"^\s+\d+\s+\d+\.\d\d\s+\d+\.\d\d", line)}
    assert sorted(rows) == list(range(B))
    assert float(rows[0][0]) == round(acc["drafter"], 2)
    for k in range(1, B):
        assert [float(v) for v in rows[k]] == [round(acc["refined"][c][k - 1], 2) for c in ("0", "4")]
    # Resuming with other training options would not continue the same run: refused, naming --resume.
    code, out3, err3 = run(capsys, "demo", "--tiny", "--out", str(out_dir), "--resume", "-q", "--lr", "0.01")
    assert code == 2 and "--resume" in err3.splitlines()[-1] and "different run" in err3, err3


@pytest.mark.slow
def test_demo_tiny_resumed_measures_the_same(tmp_path, capsys):
    """Seeded: resuming from the final checkpoint trains nothing and measures the same numbers."""
    out_dir, _, _ = _demo_tiny(tmp_path, capsys)
    acc = json.loads((out_dir / "results.json").read_text())["accepted_length"]
    code, out2, err2 = run(capsys, "demo", "--tiny", "--out", str(out_dir), "--resume", "-q", "--no-plot")
    assert code == 0, err2
    assert "resumed from step" in out2 and err2 == ""
    assert json.loads((out_dir / "results.json").read_text())["accepted_length"] == acc


@pytest.mark.slow
def test_demo_resume_says_what_it_does(tmp_path, capsys):
    """--resume without a saved state says that it trains from scratch; a resume with more --steps is refused,
    saying why (the schedule's length) and what to run instead."""
    out_dir = tmp_path / "out"
    code, out, err = run(capsys, "demo", "--tiny", "--out", str(out_dir), "--resume", "-q", "--no-plot")
    assert code == 0, err
    assert f"resume: no saved train state in {out_dir / 'train_state'}: training from scratch" in out
    code, out, err = run(capsys, "demo", "--tiny", "--out", str(out_dir), "--resume", "-q", "--steps", "80")
    last = err.splitlines()[-1]
    assert code == 2 and last.startswith("xpress demo: error: --resume:"), err
    assert "train_config.steps: 40 in the checkpoint, 80 now" in last and "schedule" in last
    assert "without --resume" in last and "--steps 40 resumes this run" in last


@pytest.mark.slow
def test_demo_tiny_compares_the_recipes(tmp_path, capsys):
    out_dir = tmp_path / "out"
    code, out, err = run(capsys, "demo", "--tiny", "--recipe", "speculators", "--compare-recipes", "--out",
                         str(out_dir), "-q", "--no-plot")
    assert code == 0, err
    assert "recipe: speculators: vLLM speculators' XPress recipe" in out and "Recipes compared" in out
    res = json.loads((out_dir / "results.json").read_text())
    assert res["train"]["recipe"] == "speculators" and res["head_config"]["predecessor"] == "previous"
    modes = res["recipes"]["modes"]
    assert set(modes) == {"greedy", "T=1"} and all(set(m["refined"]) == {"ce", "speculators"} for m in modes.values())
    # The main run's head is the comparison's greedy speculators head: the same numbers.
    assert modes["greedy"]["refined"]["speculators"] == res["accepted_length"]["refined"]["0"]
    header = next(line for line in out.splitlines() if "greedy: ce" in line)
    assert header.split() == ["K", "greedy:", "ce", "greedy:", "speculators", "T=1:", "ce", "T=1:", "speculators"]
    B = res["task"]["block_size"]
    rows = [line.split() for line in out.splitlines()[out.splitlines().index(header) + 1:][:B]]
    assert [float(v) for v in rows[0][1:5]] == [round(modes[m]["drafter"], 2) for m in ("greedy",) * 2 + ("T=1",) * 2]
    for k in range(1, B):
        assert [float(v) for v in rows[k][1:]] == [round(modes[m]["refined"][r][k - 1], 2)
                                                   for m in ("greedy", "T=1") for r in ("ce", "speculators")]


@pytest.mark.slow
def test_demo_tiny_with_a_temperature_measures_speculative_sampling(tmp_path, capsys):
    out_dir = tmp_path / "out"
    code, out, err = run(capsys, "demo", "--tiny", "--temperature", "1", "--out", str(out_dir), "-q", "--no-plot")
    assert code == 0, err
    assert out.strip().endswith("OK") and "speculative sampling at T=1" in out
    assert "trained on continuations sampled from the target at T=1" in out  # not on the greedy continuation
    acc = json.loads((out_dir / "results.json").read_text())["accepted_length"]
    B = json.loads((out_dir / "results.json").read_text())["task"]["block_size"]
    assert json.loads((out_dir / "results.json").read_text())["task"]["temperature"] == 1.0  # the task's chain at T
    assert acc["temperature"] == 1.0 and set(acc["seed_block"]) == set(acc["refined"]) == {"0", "4"}
    # The printed table is the measured numbers: row K=0 each mode's seed sample, row K=k the refined k passes.
    rows = {int(line.split()[0]): line.split()[1:3] for line in out.splitlines()
            if re.match(r"^\s+\d+\s+\d+\.\d\d\s+\d+\.\d\d", line)}
    assert sorted(rows) == list(range(B)) and "(drafter alone: the seed sample)" in out
    assert [float(v) for v in rows[0]] == [round(acc["seed_block"][c], 2) for c in ("0", "4")]
    for k in range(1, B):
        assert [float(v) for v in rows[k]] == [round(acc["refined"][c][k - 1], 2) for c in ("0", "4")]


@pytest.mark.slow
def test_sampled_accepted_length_aligns_the_target_with_the_draft():
    """The drafter's slot 1 is the target's own next-token distribution (the 1-step marginal), so at K = 0 the
    rejection sampler accepts it in every block: a target read at the wrong positions would not. Top-V's seed
    sample is the full-vocabulary one (the same noise of the same ids)."""
    from xpress_jax.demo import evaluate_sampled
    from xpress_jax.toy import ToyConfig, ToyTask

    task = ToyTask(ToyConfig(vocab_size=16, block_size=4, hidden_size=8))
    cfg = task.head_config(rank=8, mlp_hidden=8, topc=16, max_num_reqs=64)
    head = xj.Head(cfg, xj.init_params(cfg, jax.random.key(0), std=0.3))
    res = evaluate_sampled(task, head, temperature=1.0, n_blocks=64, topcs=(0, 16), max_passes=1)
    assert res["drafter"] == res["seed_block"][0] == res["seed_block"][16]
    assert 1.0 <= res["drafter"] < 3.0  # slot 1 always; not every block whole
    assert all(len(row) == 1 and 0 <= row[0] <= 3 for row in res["refined"].values())
    with pytest.raises(ValueError, match="temperature must be a finite float > 0"):
        evaluate_sampled(task, head, temperature=0.0, n_blocks=8)


@pytest.mark.parametrize(
    "argv,option",
    [
        (["--steps", "0"], "--steps"),
        (["--vocab", "300"], "--vocab"),
        (["--block", "1"], "--block"),
        (["--topc", "0"], "--topc"),
        (["--topc", "99"], "--topc"),
        (["--topc", "a,b"], "--topc"),
        (["--lr", "0"], "--lr"),
        (["--eval-blocks", "0"], "--eval-blocks"),
        (["--dtype", "float16"], "--dtype"),
        (["--temperature", "0"], "--temperature"),
        (["--temperature", "nan"], "--temperature"),
        (["--temperature", "-1"], "--temperature"),
        (["--recipe", "kl_div"], "--recipe"),
    ],
)
def test_demo_refuses_nonsense_with_exit_2_naming_the_option(tmp_path, capsys, argv, option):
    code, out, err = run(capsys, "demo", "--tiny", "--out", str(tmp_path / "o"), *argv)
    assert code == 2, (out, err)
    assert option in err.splitlines()[-1], err
    assert not (tmp_path / "o").exists()  # refused before anything is written


@pytest.mark.parametrize("where", ["file", "unwritable"])
def test_demo_refuses_a_bad_out_with_exit_2_naming_it(tmp_path, capsys, where):
    out = tmp_path / "a_file" if where == "file" else "/proc/nope"
    if where == "file":
        out.write_text("not a folder")
    code, stdout, err = run(capsys, "demo", "--tiny", "--out", str(out))
    assert code == 2, (stdout, err)
    assert err.splitlines()[-1].startswith("xpress demo: error: --out "), err
    assert "Traceback" not in err and "internal error" not in err


def test_train_progress_eta_starts_after_the_first_step():
    import io

    from xpress_jax.train import _Bar

    stream = io.StringIO()
    bar = _Bar(10, True, stream)
    for step in range(1, 11):
        bar(step, 1.0, 0.5, 0.0, final=step == 10)
    lines = stream.getvalue().splitlines()
    assert "eta" not in lines[0] and "compile" in lines[0] and all("eta" in line for line in lines[1:]), lines


def test_demo_help_names_every_option_and_its_default(capsys):
    assert cli.main(["demo", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for opt in ("--steps", "--batch", "--topc", "--out", "--tiny", "--resume", "--dtype", "--eval-blocks",
                "--temperature", "--recipe", "--compare-recipes"):
        assert opt in text
    assert "default: 1500" in text and "with --tiny: 40" in text
