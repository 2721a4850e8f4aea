"""Every code block of README.md runs as written.

The blocks run in README order, in a temporary working directory that holds a tiny
drafter checkpoint at ``path/to/drafter`` (the path the "Convert a checkpoint" commands
use), so the converter commands, then the Python snippet that loads ``head_ckpt``,
run exactly as printed.

- ```python blocks: each in a fresh namespace (every snippet is self-contained; the
  only thing one block leaves for a later one is ``head_ckpt`` on disk).
- ```text blocks: example output, not run.
- ```bash blocks: each ``xpress ...`` / ``xpress-convert ...`` command runs in-process
  through the console scripts' ``main`` and must exit 0. The other commands are not run:
  each one must be listed in `NOT_RUN` with the reason, so a new README command is
  either executed here or consciously exempted.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import numpy as np
import pytest

README = Path(__file__).resolve().parents[1] / "README.md"

NOT_RUN = {
    'pip install -e .': "installs the package (this suite runs from the installed or PYTHONPATH tree)",
    'pip install -e ".[test]"': "installs the test extra",
    'pip install -e ".[cuda12]"': "GPU install",
    'pip install -e ".[bench]"': "installs matplotlib",
    'python -m benchmarks.bench_kernels --out results/': "GPU benchmark (its CPU smoke run: test_bench_kernels_smoke.py)",
    'pip install torch --index-url https://download.pytorch.org/whl/cpu': "downloads torch",
    'pip install torch': "downloads torch",
    'python -m pytest -q -n 2': "this test suite itself",
    'xpress demo': "the default end-to-end run (~1 min on 2 CPU cores); test_cli runs it at --tiny size",
    'python -m benchmarks.bench_refine --out results/': "the GPU sweep (serving shapes)",
    'python -m benchmarks.bench_refine --small': "a CPU smoke run of a minute or more",
    'python -m benchmarks.agreement --out results/': "GPU only",
    'python -m benchmarks.agreement vllm --out results/': "GPU only (serving shapes, PyTorch on CUDA)",
    'python -m benchmarks.fixed_point --out results/': "trains a head for ~1 min (its checks: test_bench_smoke.py)",
    'python -m benchmarks.serving_loop --out results/': "GPU (serving shapes; its CPU smoke run: test_bench_smoke.py)",
    'python examples/serving_step.py': "trains a head first (~10 s on 2 CPU cores); tests/test_examples.py runs "
                                       "its --smoke mode and checks its step",
}


def blocks() -> list[tuple[str, str, int]]:
    """(language, code, line number) of every fenced block, in order."""
    text = README.read_text()
    out = []
    for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, flags=re.M | re.S):
        out.append((m.group(1), m.group(2), text.count("\n", 0, m.start()) + 1))
    return out


def commands(code: str) -> list[str]:
    """The commands of a bash block: comments dropped, `a && b` split."""
    out = []
    for line in code.splitlines():
        line = re.sub(r"(^|\s)#.*$", "", line)  # README commands hold no '#' inside quotes
        out += [" ".join(c.split()) for c in line.split("&&") if c.strip()]
    return out


def write_drafter(folder: Path) -> None:
    """A tiny vLLM-style drafter checkpoint: backbone + the head under ``xpress_head.``, raw mixer."""
    from xpress_jax.convert import save_file
    from xpress_jax import HeadConfig
    from xpress_jax.params import source_shapes

    hf = {"architectures": ["XPressDrafter"], "vocab_size": 64, "hidden_size": 16, "xpress_block_size": 6,
          "xpress_rank": 8, "xpress_mlp_hidden": 16, "xpress_topc": 10, "xpress_num_passes": 3, "max_num_seqs": 4}
    rng = np.random.default_rng(0)
    tensors = {f"xpress_head.{k}": (rng.standard_normal(s) * 0.3).astype(np.float32)
               for k, s in source_shapes(HeadConfig.from_hf_config(hf)).items()}
    tensors["model.layers.0.mlp.up_proj.weight"] = rng.standard_normal((32, 16)).astype(np.float32)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(hf))
    save_file(tensors, folder / "model.safetensors")


def test_readme_has_the_two_commands():
    text = README.read_text()
    section = text.split("## The two commands", 1)[1].split("\n## ", 1)[0]
    lang, code, _ = next(b for b in blocks() if b[1] in section)
    assert lang == "bash"
    assert code.splitlines() == ["pip install -e . && xpress demo",
                                 'pip install -e ".[test]" && python -m pytest -q -n 2']


def test_every_readme_block_runs(tmp_path, monkeypatch, capsys):
    from xpress_jax.convert.cli import main as convert_main
    from xpress_jax.cli import main as xpress_main

    monkeypatch.chdir(tmp_path)
    write_drafter(tmp_path / "path" / "to" / "drafter")
    ran = {"python": 0, "bash": 0}
    for lang, code, line in blocks():
        where = f"README.md block at line {line}"
        if lang == "python":
            exec(compile(code, where, "exec"), {"__name__": "__readme__"})
            ran["python"] += 1
        elif lang == "bash":
            for cmd in commands(code):
                words = shlex.split(cmd)
                if cmd in NOT_RUN:
                    continue
                if words[0] == "xpress":
                    code_ = xpress_main(words[1:])
                elif words[0] == "xpress-convert":
                    code_ = convert_main(words[1:])
                else:
                    pytest.fail(f"{where}: {cmd!r} is neither run by this test nor listed in NOT_RUN")
                out, err = capsys.readouterr()
                assert code_ == 0, f"{where}: {cmd!r} exited {code_}\n{out[-2000:]}\n{err[-2000:]}"
                ran["bash"] += 1
        elif lang == "text":
            continue  # printed output shown as an example, not a command
        else:
            pytest.fail(f"{where}: a code block without a language ({lang!r}); mark it python, bash or text")
    assert ran["python"] >= 3 and ran["bash"] >= 6, ran
    assert (tmp_path / "head_ckpt").is_dir()


def test_not_run_lists_only_commands_the_readme_has():
    present = {c for lang, code, _ in blocks() if lang == "bash" for c in commands(code)}
    assert set(NOT_RUN) <= present, sorted(set(NOT_RUN) - present)
