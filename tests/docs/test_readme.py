"""README.md and docs/: the commands and code a user copies, and the files they cite.

Fast checks: the two commands; the README's test command equals `.ci/run`'s ``TEST_CMD``; every
bash command is either run by the slow test or listed in `NOT_RUN` with the reason; every python
block compiles; every repository path cited in README.md and docs/*.md exists.

`test_every_readme_block_runs` (slow: it compiles every snippet, ~20 s on 2 cores) runs the blocks
in README order, in a temporary working directory that holds a tiny drafter checkpoint at
``path/to/drafter`` (the path the "Convert a checkpoint" commands use):

- ```python blocks: each in a fresh namespace (the only thing one block leaves for a later one is
  ``head_ckpt`` on disk).
- ```text blocks: example output, not run.
- ```bash blocks: each ``xpress ...`` / ``xpress-convert ...`` command runs in-process through the
  console scripts' ``main`` and must exit 0; ``XLA_FLAGS=... python examples/...`` runs in a child process (the
  flag must be set before JAX starts); every other command must be in `NOT_RUN`.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))

NOT_RUN = {
    'pip install -e .': "installs the package (this suite runs from the installed or PYTHONPATH tree)",
    'pip install -e ".[test]"': "installs the test extra",
    'pip install torch --index-url https://download.pytorch.org/whl/cpu': "downloads torch",
    'python -m pytest -q -n 2': "this test suite itself",
    'xpress demo': "the end-to-end run (~1 min on 2 CPU cores); tests/training/test_cli.py runs it at --tiny size",
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


@pytest.mark.slow
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
                if words[0].startswith("XLA_FLAGS=") and words[1:2] == ["python"]:  # an example, in a child process
                    env = dict(os.environ, XLA_FLAGS=words[0].split("=", 1)[1], PYTHONPATH=str(ROOT))
                    proc = subprocess.run(words[1:], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
                    code_ = proc.returncode
                    print(proc.stdout, proc.stderr)
                    # The output the README promises in the line's comment ("# ... equal to one device's: True").
                    promised = re.search(re.escape(words[-1]) + r"\s*#\s*\.\.\.\s*(.+)$", code, re.M)
                    if promised:
                        assert promised.group(1).strip() in proc.stdout, (
                            f"{where}: {cmd!r} did not print {promised.group(1).strip()!r}:\n{proc.stdout}")
                elif words[0] == "xpress":
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


def test_readme_test_command_is_ci_test_command():
    m = re.search(r'^TEST_CMD="([^"]*)"', (ROOT / ".ci" / "run").read_text(), flags=re.M)
    assert m, ".ci/run defines no TEST_CMD"
    readme_cmd = commands(next(code for lang, code, _ in blocks() if lang == "bash"))[-1]
    assert readme_cmd == m.group(1), (readme_cmd, m.group(1))


def test_every_bash_command_is_run_or_exempt():
    for lang, code, line in blocks():
        if lang == "bash":
            for cmd in commands(code):
                words = cmd.split()
                example = words[0].startswith("XLA_FLAGS=") and words[1:3] == ["python", words[2]] and \
                    words[2].startswith("examples/") and (ROOT / words[2]).is_file()
                assert cmd in NOT_RUN or words[0] in ("xpress", "xpress-convert") or example, (line, cmd)


def test_every_python_block_compiles():
    n = 0
    for lang, code, line in blocks():
        if lang == "python":
            compile(code, f"README.md block at line {line}", "exec")
            n += 1
    assert n >= 3
    assert all(lang in ("python", "bash", "text") for lang, _, _ in blocks())


#: A path in the repository, as the docs cite it: under one of these folders, or a top-level file.
CITED = re.compile(r"(?<![\w./-])((?:xpress_jax|tests|benchmarks|examples|docs|\.ci)/[\w./-]*[\w/]"
                   r"|LICENSE|pyproject\.toml)")


def cited_paths(md: Path) -> set[str]:
    """Paths cited in ``md``: in `code spans` and as relative link targets (resolved from its folder)."""
    text = md.read_text()
    out = set()
    for span in re.findall(r"`([^`\n]+)`", text):
        out |= {m.group(1) for m in CITED.finditer(span) if "/" in m.group(1) or span == m.group(1)}
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" not in target:
            out.add(str((md.parent / target).resolve().relative_to(ROOT)))
    return out


@pytest.mark.parametrize("md", [README, *DOCS], ids=lambda p: p.name)
def test_cited_paths_exist(md):
    missing = sorted(p for p in cited_paths(md) if not (ROOT / p).exists())
    assert not missing, f"{md.name} cites paths that do not exist: {missing}"
