"""Orbax checkpoints of heads with the newer config fields: a reduced draft vocabulary's int32 ``d2t`` and the
``predecessor`` convention, stored and restored; heads without them stay format version 1, as before."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import xpress_jax as xj

BASE = dict(vocab_size=50, hidden_size=12, block_size=5, rank=8, mlp_hidden=16, topc=7, num_passes=2, max_num_reqs=4)


def _info(path):
    return json.loads((path / "xpress" / "metadata").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_reduced_head_round_trip(tmp_path, dtype):
    cfg = xj.HeadConfig(**BASE, draft_vocab_size=30, predecessor="previous")
    head = xj.init_head(cfg, 3, dtype)
    xj.save_params(tmp_path / "ck", head)
    info = _info(tmp_path / "ck")
    assert info["format_version"] == 2 and info["param_names"][-1] == "d2t"
    assert info["config"]["draft_vocab_size"] == 30 and info["config"]["predecessor"] == "previous"
    back = xj.load_params(tmp_path / "ck")
    assert back.config == cfg and back.params.keys() == head.params.keys()
    assert back.params["d2t"].dtype == jnp.int32 and back.dtype == jnp.dtype(dtype)
    for k in head.params:
        np.testing.assert_array_equal(np.asarray(back.params[k]), np.asarray(head.params[k]), err_msg=k)
    # A dtype cast leaves d2t int32; a sharding dict may name it.
    dev = jax.devices()[0]
    cast = xj.load_params(tmp_path / "ck", dtype=jnp.float32, sharding={"d2t": dev, "w2": dev})
    assert cast.params["d2t"].dtype == jnp.int32 and cast.params["w2"].dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(cast.params["d2t"]), np.asarray(head.params["d2t"]))


def test_plain_heads_stay_version_1_and_old_checkpoints_load(tmp_path):
    cfg = xj.HeadConfig(**BASE)
    xj.save_params(tmp_path / "ck", xj.init_head(cfg, 0))
    info = _info(tmp_path / "ck")
    # Written as before: no new fields, version 1, so an older xpress-jax reads it too.
    assert info["format_version"] == 1 and "d2t" not in info["param_names"]
    assert not {"draft_vocab_size", "predecessor"} & set(info["config"])
    back = xj.load_params(tmp_path / "ck", sharding={"d2t": jax.devices()[0]})  # named, ignored: no d2t
    assert back.config == cfg and back.config.predecessor == "anchor" and "d2t" not in back.params
    # Only the predecessor set: version 2, no d2t.
    prev = xj.HeadConfig(**BASE, predecessor="previous")
    xj.save_params(tmp_path / "prev", xj.init_head(prev, 0))
    assert _info(tmp_path / "prev")["format_version"] == 2 and xj.load_params(tmp_path / "prev").config == prev


def test_a_reduced_checkpoint_without_its_d2t_is_refused(tmp_path):
    cfg = xj.HeadConfig(**BASE)
    xj.save_params(tmp_path / "ck", xj.init_head(cfg, 0))
    meta = tmp_path / "ck" / "xpress" / "metadata"
    info = json.loads(meta.read_text())
    info["config"]["draft_vocab_size"] = 30  # the stored arrays are a full-vocabulary head's
    meta.write_text(json.dumps(info))
    with pytest.raises(ValueError, match=r"d2t: stored nothing.*expected \(30,\) int32"):
        xj.load_params(tmp_path / "ck")
    with pytest.raises(ValueError, match=r"unknown param name\(s\) \['bogus'\]"):
        xj.load_params(tmp_path / "ck", sharding={"bogus": None})
