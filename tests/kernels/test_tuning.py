"""Tables per GPU family (`xpress_jax.dispatch.TABLES`): shared memory per target, the measured H100/H200 table
kept as it is, thresholds read from the table."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import pytest

from xpress_jax import dispatch
from xpress_jax.kernels import common, full_vocab, latent
from xpress_jax.kernels.common import HOPPER, TARGETS, Target
from xpress_jax.ops import Ops
from xpress_jax.refine import exit_checks

V, R, B, C = 151936, 256, 16, 512  # serving shapes
KB = 1024
SIXTEEN_BIT = (jnp.bfloat16, jnp.float16)


def _device(cc, kind="NVIDIA GPU", cores=None):
    return type("GPU", (), dict(platform="gpu", device_kind=kind, compute_capability=cc, core_count=cores))()


@pytest.mark.parametrize("cc,smem", [("9.0", 227), ("10.0", 227), ("8.0", 163), ("8.7", 163), ("8.6", 99),
                                     ("8.9", 99), ("12.0", 99), ("7.5", 99), ("11.0", 99)])
def test_shared_memory_per_compute_capability(cc, smem):
    t = common.target_of(_device(cc))
    assert t.smem == smem * KB and t.capability == tuple(int(x) for x in cc.split("."))
    assert (t.family in TARGETS) == (cc not in ("7.5", "11.0"))  # unknown: the smallest limit


def test_device_sm_count_replaces_the_family_default():
    assert common.target_of(_device("9.0", cores=132)) is HOPPER
    assert common.target_of(_device("8.0", cores=124)).sms == 124
    assert common.target_of(_device("8.0")).sms == TARGETS["sm80"].sms
    assert common.target_of(type("CPU", (), dict(platform="cpu"))()) is None


def test_the_hopper_table_is_the_measured_one():
    assert dispatch.TABLES["sm90"] is dispatch.TABLE
    assert dispatch.table_for(HOPPER) is dispatch.TABLE
    assert dispatch.table_for(dataclasses.replace(HOPPER, sms=114)) is dispatch.TABLE  # the family decides
    assert dispatch.table_for(None) is dispatch.TABLE  # no GPU: interpret mode, lowering on a CPU
    assert dispatch.TABLE.target == HOPPER and dispatch.TABLE.sms == HOPPER.sms
    assert Ops.pallas(True) is Ops.pallas(True, table=dispatch.TABLE)


def _unknown():
    return common.target_of(_device("7.5", kind="NVIDIA Tesla T4", cores=40))


@pytest.mark.parametrize("family", [*TARGETS, "unknown"])
@pytest.mark.parametrize("dtype", SIXTEEN_BIT, ids=lambda d: jnp.dtype(d).name)
def test_each_table_fits_its_target(family, dtype):
    """Every entry's full-vocab config (and fused latent) fits the per-block shared memory of the target its table
    is chosen for, at the serving rank; `plan` serves those configs as they are and their checks pass."""
    target = _unknown() if family == "unknown" else TARGETS[family]
    table = dispatch.table_for(target)
    assert table.target == target and table.sms == (HOPPER.sms if table is dispatch.TABLE else target.sms)
    for e in table.entries:
        assert e.full_vocab.smem_bytes(R, dtype) <= target.smem
        if e.latent == "fused":
            assert latent.default_config(1, dtype, "fused", R).smem_bytes(R, dtype) <= target.smem
        rows = e.max_rows or 4000
        p = dispatch.plan(rows, 2, V, R, C, dtype, table=table)
        assert p.entry is e and p.full_vocab == e.full_vocab
        assert p.latent is None or p.latent.variant == "split" or p.latent.smem_bytes(R, dtype) <= target.smem


@pytest.mark.parametrize("family", [*TARGETS, "unknown"])
def test_fitted_tables_change_only_what_does_not_fit(family):
    """A heuristic table is the measured one with only the configs that exceed the target's shared memory
    changed (fitted down), and the wave from the target's SM count."""
    target = _unknown() if family == "unknown" else TARGETS[family]
    table = dispatch.table_for(target)
    for e, m in zip(table.entries, dispatch.TABLE.entries, strict=True):
        fits = m.full_vocab.smem_bytes(R, jnp.bfloat16) <= target.smem
        assert (e.full_vocab == m.full_vocab) == fits
        assert dataclasses.replace(e, full_vocab=m.full_vocab, latent=m.latent) == m
    assert (table.select_finish_warps, table.topc_keep_bytes, table.thresholds) == (
        dispatch.TABLE.select_finish_warps, dispatch.TABLE.topc_keep_bytes, dispatch.TABLE.thresholds)


def test_small_gpus_get_smaller_configs():
    """On 99 KB GPUs the measured 160 KB configs (latent held, whole-rank chunks) are fitted down."""
    for family in ("sm86", "sm89", "sm120"):
        big = [e.full_vocab.smem_bytes(R, jnp.bfloat16) for e in dispatch.TABLES[family].entries]
        assert max(big) <= 99 * KB
    assert max(e.full_vocab.smem_bytes(R, jnp.bfloat16) for e in dispatch.TABLE.entries) > 99 * KB


def test_check_shape_names_the_limit_and_the_target():
    cfg = dispatch.TABLE.entries[-1].full_vocab
    cfg.check_shape(256, V, R, jnp.bfloat16)  # the default limit: an H100/H200's
    with pytest.raises(ValueError, match=r"99 KB a RTX 40xx/L4/L40 program"):
        cfg.check_shape(256, V, R, jnp.bfloat16, TARGETS["sm89"].smem, TARGETS["sm89"].name)
    fused = latent.default_config(1, jnp.bfloat16, "fused", R)
    fused.check_shape(R, jnp.bfloat16)
    with pytest.raises(ValueError, match=r"99 KB a RTX 30xx/A10/A40 program"):
        fused.check_shape(R, jnp.bfloat16, TARGETS["sm86"].smem, TARGETS["sm86"].name)
    fitted = full_vocab.fit_shared_memory(cfg, R, jnp.bfloat16, 99 * KB)
    assert fitted != cfg and fitted.smem_bytes(R, jnp.bfloat16) <= 99 * KB
    assert full_vocab.default_config(240, V, R, jnp.float32, 99 * KB).smem_bytes(R, jnp.float32) <= 99 * KB


def test_thresholds_come_from_the_table():
    """The early-exit schedule follows the table's ``exit_every_pass_from``; the Pallas steps carry their table's
    thresholds (the certified mode's, the hidden input's)."""
    t = dispatch.TABLE.thresholds
    assert exit_checks(15, 6, t.exit_every_pass_from) == (2, 4)
    assert exit_checks(15, 6, 8) == (2, 3, 4, 5)  # a lower threshold: every pass at N = 15
    moved = dispatch.TABLE.replace(thresholds=dataclasses.replace(t, exit_every_pass_from=8, materialize_xh=(1, 2)))
    ops = Ops.pallas(False, table=moved)
    assert ops.thresholds.exit_every_pass_from == 8 and ops.hidden.keywords == {"materialize": (1, 2)}
    assert Ops.pallas(False, table=dispatch.TABLE).thresholds == t


@pytest.mark.slow
def test_refine_reads_the_exit_threshold_from_its_steps():
    """Changing the table's ``exit_every_pass_from`` changes the checks an unrolled early-exit refine traces."""
    import jax

    import xpress_jax as xj
    from helpers import make_head, make_inputs
    from xpress_jax.refine import refine_with

    cfg = xj.HeadConfig(vocab_size=97, hidden_size=16, block_size=5, rank=24, mlp_hidden=32, topc=7)
    head = xj.Head(cfg, make_head(cfg))
    x = make_inputs(cfg, 2)
    t = dispatch.TABLE.thresholds

    def conds(every):
        ops = dataclasses.replace(Ops.xla(), thresholds=dataclasses.replace(t, exit_every_pass_from=every))
        run = lambda *a: refine_with(ops, head, *a, num_passes=6, unroll=True, early_exit=True)  # noqa: E731
        return str(jax.make_jaxpr(run)(*x)).count("cond[")

    assert conds(t.exit_every_pass_from) == 2 and conds(2) == 4  # N = 2: passes (2, 4), then (2, 3, 4, 5)
