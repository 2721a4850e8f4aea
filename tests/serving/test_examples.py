"""examples/serving_step.py: the jitted draft step of a toy serving loop.

The example's functions on its ``--smoke`` head (untrained, random: refine changes about a third of
the drafter's tokens, so comparing tokens compares real work), checked against what is computed
outside its jit: a standalone `refine` on the same drafter outputs, and `toy.accepted_length`
against the task's own table of greedy continuations. Then the command itself, in smoke mode.
"""

from __future__ import annotations

import contextlib
import importlib.util
import re
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import xpress_jax as xj
from xpress_jax.toy import accepted_length

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "serving_step.py"
R = 16  # requests
REQUEST_TOKENS = 12  # short, so that requests finish (and are replaced) within the steps run here


@pytest.fixture(scope="module")
def ex():
    """The example, imported from its file (examples/ is not a package)."""
    spec = importlib.util.spec_from_file_location("serving_step", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def task(ex):
    return ex.toy_task()  # the example's own (cached: built once per process)


@pytest.mark.parametrize("num_passes, topc", [pytest.param(7, 0, marks=pytest.mark.slow), (3, 5)])
@pytest.mark.slow
def test_draft_step_matches_what_is_computed_outside_it(ex, task, num_passes, topc):
    V, B = task.config.vocab_size, task.config.block_size
    head, _ = ex.random_head(task, 0, R)
    tables = ex.serving_tables(task)
    state = ex.initial_state(tables, R, seed=1)
    greedy, greedy_next = task.tables["greedy"], task.greedy_next  # [V*V, B] (anchor first), [V, V]
    refine = jax.jit(xj.refine, static_argnames=xj.STATIC_ARGNAMES)
    traces, changed, accepted, finished = ex.TRACES, 0, [], 0
    for step in range(5):
        # copies (np.array): a numpy view of a state array would keep its buffer from being donated
        prev, anchor, generated, done_before = (np.array(x) for x in state[:4])
        old = state
        with jax.no_tracing() if step else contextlib.nullcontext():  # step 1 traces, the others must not
            state, out = ex.draft_step(head, tables, state, num_passes=num_passes, topc=topc,
                                       request_tokens=REQUEST_TOKENS)
        assert all(x.is_deleted() for x in old), "the donated state must be consumed"
        draft, acc = np.asarray(out.draft), np.asarray(out.accepted)

        # refine inside the step == a standalone refine call on the same drafter outputs
        logits, h = ex.drafter(tables, jnp.asarray(prev), jnp.asarray(anchor), head.dtype)
        alone = refine(head, logits, h, jnp.asarray(anchor), jnp.asarray(prev), num_passes=num_passes, topc=topc)
        np.testing.assert_array_equal(draft, np.asarray(alone))
        own = np.argmax(task.tables["drafter_logits"][prev * V + anchor, 1:], axis=-1)
        changed += int((draft != own).sum())

        # accepted lengths: in [0, B-1], and toy.accepted_length against the task's greedy table
        cont = greedy[prev * V + anchor]  # [R, B]: anchor, g1..g_{B-1}
        assert ((acc >= 0) & (acc <= B - 1)).all()
        np.testing.assert_array_equal(acc, np.asarray(accepted_length(draft, cont[:, 1:])))
        np.testing.assert_array_equal(np.asarray(out.drafter_accepted), np.asarray(accepted_length(own, cont[:, 1:])))
        accepted += acc.tolist()

        # the state moves past the accepted tokens and the target's own token: the new context is the
        # last two tokens of [prev, anchor, g1..g_{acc+1}]; a request with REQUEST_TOKENS finishes
        seq = np.concatenate([prev[:, None], cont, greedy_next[cont[:, -2], cont[:, -1]][:, None]], axis=1)
        rows = np.arange(R)
        done = generated + acc + 1 >= REQUEST_TOKENS
        new = [np.array(x) for x in state[:4]]  # copies, as above
        np.testing.assert_array_equal(np.asarray(out.finished), done)
        np.testing.assert_array_equal(new[0][~done], seq[rows, acc + 1][~done])
        np.testing.assert_array_equal(new[1][~done], seq[rows, acc + 2][~done])
        np.testing.assert_array_equal(new[2], np.where(done, 0, generated + acc + 1))
        np.testing.assert_array_equal(new[3], done_before + done)
        assert ((new[0] >= 0) & (new[0] < V) & (new[1] >= 0) & (new[1] < V)).all()
        finished += int(done.sum())
    assert ex.TRACES - traces == 1
    assert changed > 0 and finished > 0 and len(set(accepted)) > 2, (changed, finished, sorted(set(accepted)))


@pytest.mark.slow
def test_verify_accepts_the_greedy_continuation_and_adds_the_targets_token(ex, task):
    """A draft equal to the target's continuation: all B-1 accepted, and the token after the block."""
    V, B = task.config.vocab_size, task.config.block_size
    ctx = np.arange(0, V * V, 97)
    cont = task.tables["greedy"][ctx]
    acc, last, bonus = ex.verify(jnp.asarray(task.greedy_next), jnp.asarray(ctx // V), jnp.asarray(cont[:, 0]),
                                 jnp.asarray(cont[:, 1:]))
    assert (np.asarray(acc) == B - 1).all()
    np.testing.assert_array_equal(last, cont[:, -1])
    np.testing.assert_array_equal(bonus, task.greedy_next[cont[:, -2], cont[:, -1]])


@pytest.mark.slow
def test_the_state_buffers_are_aliased_without_a_warning(ex, task):
    """XLA writes the new state into the donated one (input_output_alias), with no "donated buffers
    were not usable" warning: checked on the compiled step."""
    head, _ = ex.random_head(task, 0, R)
    tables = ex.serving_tables(task)
    state = ex.initial_state(tables, R, seed=1)
    with warnings.catch_warnings():
        # Only the donation warning is an error here: on a GPU, lowering the Pallas-Triton kernels also warns
        # (JAX 0.11 deprecated that backend), which says nothing about donation.
        warnings.filterwarnings("error", message=".*[Dd]onated buffers.*")
        compiled = ex.draft_step.lower(head, tables, state, num_passes=2, topc=0,
                                       request_tokens=REQUEST_TOKENS).compile()
    first = len(jax.tree.leaves((head, tables)))  # the state's leaves come after the head's and the tables'
    pairs = re.findall(r"\{(\d+)\}: \((\d+), \{\}, (?:may|must)-alias\)", compiled.as_text())
    assert sorted((int(o), int(i)) for o, i in pairs) == [(k, first + k) for k in range(len(state))]


@pytest.mark.slow
def test_the_command_in_smoke_mode(ex, capsys):
    assert ex.main(["--smoke", "--steps", "3", "--topc", "5"]) == 0
    out = capsys.readouterr().out
    rows = [ln for ln in out.splitlines() if re.match(r"\s+\d+\s+\d+\.\d\d\s+\d+\.\d\d\s+\d+\.\d\d\s+\d+\s", ln)]
    assert [int(r.split()[0]) for r in rows] == [1, 2, 3], out
    assert "draft_step traced 1 time(s); steps 2..3 ran under jax.no_tracing()" in out
    assert "every step consumed the donated state" in out


@pytest.mark.slow
def test_bad_arguments_are_named(ex, task, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        ex.main(["--topc", "65"])
    assert e.value.code == 2 and "--topc: must be in [0, 64]" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        ex.main(["--requests", "0"])
    assert e.value.code == 2 and "--requests: must be an int >= 1, got 0" in capsys.readouterr().err
    other = xj.init_head(xj.HeadConfig(vocab_size=32, hidden_size=32, block_size=8, rank=8, mlp_hidden=8),
                         jax.random.key(0))
    xj.save_params(tmp_path / "other", other)
    assert ex.main(["--head", str(tmp_path / "other")]) == 2
    assert f"--head {tmp_path / 'other'}: a head for {{'vocab_size': 32" in capsys.readouterr().err
