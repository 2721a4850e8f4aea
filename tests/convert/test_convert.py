"""Checkpoint conversion: PyTorch-format XPress checkpoints -> Orbax -> load_params -> refine.

Source checkpoints are built inside the tests (vLLM key names, a RAW mixer):
single-file safetensors, a full drafter (backbone + ``model.`` prefix), a
sharded folder with an index, a ``.bin`` and the xPress release's training
checkpoint (torch only), bf16 safetensors.
Tokens of the converted head are compared with the PyTorch spelling of the
reference on the raw tensors (torch installed) or with the jnp path built
straight from the source tensors (no torch). Every bad input is refused with
a clear message, a non-zero exit and no destination left behind.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import struct
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import xpress_jax as xj
from xpress_jax.convert import (
    ConversionError,
    SafetensorsError,
    SafetensorsFile,
    convert_checkpoint,
    inspect_path,
    load_file,
    mixer_looks_folded,
    save_file,
)
from xpress_jax.convert.cli import main
from xpress_jax.params import source_shapes

REPO = Path(__file__).resolve().parents[2]
refine = jax.jit(xj.refine, static_argnames=xj.STATIC_ARGNAMES)  # one compile per shape for the whole file

V, H, B, R, M = 300, 32, 8, 16, 32
TOPC, K, N = 24, 7, 8
CFG = xj.HeadConfig(vocab_size=V, hidden_size=H, block_size=B, rank=R, mlp_hidden=M, topc=TOPC, num_passes=K, max_num_reqs=16)
# Scales chosen so the refiner changes about half of the drafter's tokens.
STD = {"w1.weight": 0.5, "w2.weight": 0.02, "mix.L": 0.3}


HAS_TORCH = importlib.util.find_spec("torch") is not None  # imported only where a test uses it


# ----------------------------------------------------------------------------- builders


def raw_head(seed: int = 0, dtype=np.float32) -> dict[str, np.ndarray]:
    """Head tensors in source form: HYBRID_KEY_MAP names, PyTorch layouts, RAW mixer."""
    rng = np.random.default_rng(seed)
    return {
        k: (rng.standard_normal(s) * STD.get(k, 0.3)).astype(np.float32).astype(dtype)
        for k, s in source_shapes(CFG).items()
    }


def hf_config(**over) -> dict:
    cfg = {
        "architectures": ["XPressDrafter"],
        "vocab_size": V,
        "hidden_size": H,
        "xpress_block_size": B,
        "xpress_rank": R,
        "xpress_mlp_hidden": M,
        "xpress_topc": TOPC,
        "xpress_num_passes": K,
        "max_num_seqs": 16,
    }
    cfg.update(over)
    return cfg


def backbone(seed: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "model.embed_tokens.weight": rng.standard_normal((V, H)).astype(np.float32),
        "model.layers.0.self_attn.q_proj.weight": rng.standard_normal((H, H)).astype(np.float32),
        "model.layers.0.mlp.gate_proj.weight": rng.standard_normal((2 * H, H)).astype(np.float32),
        "model.layers.1.input_layernorm.weight": np.ones((H,), np.float32),
        "model.fc.weight": rng.standard_normal((H, 3 * H)).astype(np.float32),
        "model.norm.weight": np.ones((H,), np.float32),
        "lm_head.weight": rng.standard_normal((V, H)).astype(np.float32),
        "mask_embedding": rng.standard_normal((H,)).astype(np.float32),
        "d2t": np.arange(V, dtype=np.int64),
        "t2d": np.ones((V,), dtype=bool),
    }


def write_folder(
    folder: Path,
    tensors: dict[str, np.ndarray],
    *,
    config: dict | None = None,
    shards: int = 1,
    fmt: str = "safetensors",
) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    if fmt == "bin":
        import torch

        from xpress_jax.convert.torch_reference import to_torch

        torch.save({k: to_torch(v) for k, v in tensors.items()}, folder / "pytorch_model.bin")
        return folder
    if shards == 1:
        save_file(tensors, folder / "model.safetensors")
        return folder
    keys = list(tensors)
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: tensors[k] for k in keys[i::shards]}
        save_file(part, folder / name)
        weight_map.update({k: name for k in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def prefixed(tensors: dict, prefix: str = "xpress_head.") -> dict:
    return {prefix + k: v for k, v in tensors.items()}


def inputs(seed: int = 0):
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((N, B, V)).astype(np.float32)
    h = rng.standard_normal((N, B, H)).astype(np.float32)
    anchors = rng.integers(0, V, size=(N,)).astype(np.int32)
    return logits, h, anchors


def jax_tokens(params, config, topc, seed=0):
    logits, h, anchors = inputs(seed)
    params = {k: v.astype(jnp.float32) for k, v in params.items()}
    return np.asarray(
        refine(params, jnp.asarray(logits), jnp.asarray(h), jnp.asarray(anchors), config=config, topc=topc, backend="xla")
    )


def reference_tokens(raw, topc, seed=0):
    """The PyTorch spelling on the raw tensors (torch), else the jnp path built straight from them."""
    logits, h, anchors = inputs(seed)
    if HAS_TORCH:
        from xpress_jax.convert.torch_reference import reference_refine

        return reference_refine(raw, logits, h, anchors, num_passes=K, topc=topc)
    return jax_tokens(xj.params_from_state_dict(raw, CFG, dtype=jnp.float32), CFG, topc, seed)


def assert_no_dst(dst: Path) -> None:
    assert not dst.exists(), f"{dst} was left behind"
    leftovers = [p.name for p in dst.parent.iterdir() if p.name.startswith(f".{dst.name}.tmp-")]
    assert not leftovers, f"temporary folders left behind: {leftovers}"


def refuse(src, dst, match, **kw):
    with pytest.raises(ConversionError, match=match) as exc:
        convert_checkpoint(src, dst, **kw)
    assert_no_dst(Path(dst))
    return str(exc.value)


@pytest.fixture(scope="module")
def raw():
    return raw_head()


# ----------------------------------------------------------------------------- end to end


VARIANTS = ["full_drafter", "bin"] + [pytest.param(v, marks=pytest.mark.slow) for v in ("safetensors", "sharded", "bf16")]


@pytest.mark.parametrize("variant", VARIANTS)
def test_convert_load_refine_matches_reference(tmp_path, raw, variant):
    if variant == "bin" and not HAS_TORCH:
        pytest.skip("torch not installed")
    tensors = raw if variant != "bf16" else raw_head(dtype=ml_dtypes.bfloat16)
    if variant == "full_drafter":
        files = {**backbone(), **prefixed(tensors, "model.xpress_head.")}
    else:
        files = prefixed(tensors)
    src = write_folder(
        tmp_path / "src",
        files,
        config=hf_config(),
        shards=3 if variant == "sharded" else 1,
        fmt="bin" if variant == "bin" else "safetensors",
    )
    dst = tmp_path / "out"
    report = convert_checkpoint(src, dst)
    assert report.tensors_read == 9 and report.params_written == 10
    assert report.backbone_count == (10 if variant == "full_drafter" else 0)
    assert report.dtype == ("bfloat16" if variant == "bf16" else "float32")
    assert report.prefixes == (["model.xpress_head."] if variant == "full_drafter" else ["xpress_head."])

    config, params = xj.load_params(dst)
    assert config == CFG
    assert {k: v.dtype for k, v in params.items()} == {k: jnp.dtype(report.dtype) for k in xj.PARAM_NAMES}
    for topc in (0, TOPC):
        got = jax_tokens(params, config, topc)
        want = reference_tokens(tensors, topc)
        np.testing.assert_array_equal(got, want)
    # The refiner really does something: a large share of the drafter's argmax changed.
    base = inputs()[0][:, 1:].argmax(-1)
    assert (got != base).mean() > 0.2


def test_load_params_dtype_and_folded_once(tmp_path, raw):
    src = write_folder(tmp_path / "src", prefixed(raw), config=hf_config())
    convert_checkpoint(src, tmp_path / "out", dtype="bfloat16")
    config, params = xj.load_params(tmp_path / "out")
    assert params["w1"].dtype == jnp.bfloat16
    _, p32 = xj.load_params(tmp_path / "out", dtype=jnp.float32)
    assert p32["mix"].dtype == jnp.float32
    # mix[k, j, c] = raw[c, k, j] * tril + I, rounded once to bf16 (the fold happens exactly once).
    want = (raw["mix.L"] * np.tril(np.ones((B, B))) + np.eye(B)).astype(np.float32).transpose(1, 2, 0)
    np.testing.assert_array_equal(np.asarray(params["mix"]), want.astype(ml_dtypes.bfloat16))
    np.testing.assert_array_equal(np.asarray(p32["w2"]), raw["w2.weight"].astype(ml_dtypes.bfloat16).astype(np.float32))
    np.testing.assert_array_equal(np.asarray(p32["down_h"]), raw["down_h.weight"].T.astype(ml_dtypes.bfloat16).astype(np.float32))


def test_save_load_roundtrip_and_errors(tmp_path):
    params = xj.params_from_state_dict(raw_head(dtype=ml_dtypes.bfloat16), CFG)
    path = xj.save_params(tmp_path / "ck", CFG, params, metadata={"note": "x"})
    cfg, back = xj.load_params(path)
    assert cfg == CFG
    for k in xj.PARAM_NAMES:
        np.testing.assert_array_equal(np.asarray(back[k]), np.asarray(params[k]))
    with pytest.raises(FileExistsError):
        xj.save_params(tmp_path / "ck", CFG, params)
    xj.save_params(tmp_path / "ck", CFG, params, overwrite=True)
    with pytest.raises(ValueError, match="not an xpress-jax head checkpoint"):
        xj.load_params(tmp_path)
    with pytest.raises(FileNotFoundError):
        xj.load_params(tmp_path / "nope")
    # Restored against the abstract target of the STORED config: a config that disagrees is refused.
    info_file = tmp_path / "ck" / "xpress" / "metadata"
    info = json.loads(info_file.read_text())
    info["config"]["rank"] = R * 2
    info_file.write_text(json.dumps(info))
    with pytest.raises(ValueError, match="cannot restore the params against the stored config"):
        xj.load_params(tmp_path / "ck")
    bad = dict(params, w2=params["w2"][:5])
    with pytest.raises(ValueError, match="w2"):
        xj.save_params(tmp_path / "ck2", CFG, bad)
    assert_no_dst(tmp_path / "ck2")


def test_single_file_sized_by_its_tensors(tmp_path, raw):
    # One safetensors file with bare head names and no config.json: the sizes come from the tensors.
    f = tmp_path / "head.safetensors"
    save_file(raw, f)
    report = convert_checkpoint(f, tmp_path / "out", overrides=dict(topc=TOPC, num_passes=K, max_num_reqs=16))
    assert report.prefixes == [""] and report.config == CFG and report.config_from == "the tensor shapes + flags"
    # A size flag that disagrees with the tensors is checked like config.json.
    refuse(f, tmp_path / "out2", r"mix.L: \(16, 8, 8\), expected \(16, 4, 4\)", overrides={"block_size": 4})


def test_values_no_config_sets_are_named_as_defaults(tmp_path, raw, capsys):
    # A lone file without config.json: the serving values are defaults, and the summary says so, with the flags.
    f = tmp_path / "head.safetensors"
    save_file(raw, f)
    assert main([str(f), str(tmp_path / "out"), "-q"]) == 0
    out = capsys.readouterr().out
    for needle in (f"topc={V} (512 clamped to V={V}; --topc N sets it)",
                   "num_passes=6 (Jacobi passes K; --num-passes N sets it)",
                   "max_num_reqs=256 (the largest N per call; --max-num-reqs N sets it): DEFAULTS (no config.json)"):
        assert needle in out, (needle, out)
    # A config.json without them: the same, naming the config; a flag takes its value out of the list.
    src = write_folder(tmp_path / "src", prefixed(raw), config={k: v for k, v in hf_config().items()
                                                                if k not in ("xpress_num_passes", "max_num_seqs")})
    report = convert_checkpoint(src, tmp_path / "out2", overrides={"max_num_reqs": 16})
    assert report.defaults == ["num_passes=6 (Jacobi passes K; --num-passes N sets it): DEFAULTS (no config field "
                               "or flag sets them)"]
    assert not convert_checkpoint(src, tmp_path / "out3", overrides={"max_num_reqs": 16, "num_passes": 2}).defaults


@pytest.mark.skipif(not HAS_TORCH, reason="needs torch: a .pt source")
def test_pt_with_its_tensors_one_level_down(tmp_path, raw, capsys):
    import torch

    from xpress_jax.convert.torch_reference import to_torch

    sd = {k: to_torch(v) for k, v in prefixed(raw).items()}
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "config.json").write_text(json.dumps(hf_config()))
    torch.save({"model": sd, "epoch": 3}, tmp_path / "src" / "ckpt.pt")
    report = convert_checkpoint(tmp_path / "src", tmp_path / "out")
    assert "tensors one level down under 'model'" in report.source and report.prefixes == ["xpress_head."]
    assert any("under the entry 'model'" in w and "epoch" in w for w in report.warnings)
    assert report.config == CFG
    # Two entries holding a head: refused, each named with the --prefix that picks it.
    torch.save({"model": sd, "ema": sd}, tmp_path / "src" / "ckpt.pt")
    msg = refuse(tmp_path / "src", tmp_path / "out2", "several entries hold an XPress head")
    assert "'model' (--prefix 'model.xpress_head.')" in msg and "'ema' (--prefix 'ema.xpress_head.')" in msg
    assert convert_checkpoint(tmp_path / "src", tmp_path / "out2", prefix="ema.xpress_head.").config == CFG
    # One entry holding the head, another holding other tensors: the head's entry is used.
    torch.save({"model": sd, "optim_buffers": {"x": torch.zeros(3)}}, tmp_path / "src" / "ckpt.pt")
    assert convert_checkpoint(tmp_path / "src", tmp_path / "out3").prefixes == ["model.xpress_head."]


def test_mixed_dtypes_keep_is_lossless(tmp_path, raw):
    tensors = {k: (v.astype(ml_dtypes.bfloat16) if k != "mix.L" else v) for k, v in raw.items()}
    src = write_folder(tmp_path / "src", prefixed(tensors), config=hf_config())
    report = convert_checkpoint(src, tmp_path / "out")
    assert report.dtype == "float32" and any("mixed dtypes" in w for w in report.warnings)


# ----------------------------------------------------------------------------- bad input


def test_missing_head_key_is_named(tmp_path, raw):
    src = write_folder(tmp_path / "src", prefixed({k: v for k, v in raw.items() if k != "mix.L"}), config=hf_config())
    msg = refuse(src, tmp_path / "out", "missing head tensor")
    assert "'xpress_head.mix.L'" in msg
    # No head at all: say what was looked for and what is there.
    src2 = write_folder(tmp_path / "src2", backbone(), config=hf_config())
    msg = refuse(src2, tmp_path / "out", "no XPress head tensors found")
    assert "'xpress_head.'" in msg and "model.xpress_head." in msg


def test_duplicate_key_after_prefix_stripping(tmp_path, raw):
    files = {**prefixed(raw), "model.xpress_head.w1.weight": raw["w1.weight"]}
    src = write_folder(tmp_path / "src", files, config=hf_config())
    msg = refuse(src, tmp_path / "out", "duplicate head tensor 'w1.weight'")
    assert "'xpress_head.w1.weight'" in msg and "'model.xpress_head.w1.weight'" in msg
    # The same full key in two shards is a duplicate too.
    d = tmp_path / "src2"
    d.mkdir()
    save_file(prefixed(raw), d / "a.safetensors")
    save_file({"xpress_head.w2.weight": raw["w2.weight"]}, d / "b.safetensors")
    (d / "config.json").write_text(json.dumps(hf_config()))
    refuse(d, tmp_path / "out", "duplicate tensor 'xpress_head.w2.weight'")


def test_unknown_key_under_head_prefix(tmp_path, raw):
    src = write_folder(tmp_path / "src", {**prefixed(raw), "xpress_head.mix_L": raw["mix.L"]}, config=hf_config())
    refuse(src, tmp_path / "out", "mix_L.*--mixer folded")


def test_shape_mismatch_with_config(tmp_path, raw):
    src = write_folder(tmp_path / "src", prefixed(raw), config=hf_config(xpress_rank=R // 2))
    msg = refuse(src, tmp_path / "out", "shapes do not match the config")
    assert "xpress_head.in_proj.weight: (16, 48), expected (8, 24)" in msg
    # Flags override config.json and are checked the same way.
    src2 = write_folder(tmp_path / "src2", prefixed(raw), config=hf_config())
    refuse(src2, tmp_path / "out", r"xpress_head.mix.L: \(16, 8, 8\), expected \(16, 4, 4\)", overrides={"block_size": 4})
    # A config without the required sizes.
    src3 = write_folder(tmp_path / "src3", prefixed(raw), config={"xpress_rank": R})
    refuse(src3, tmp_path / "out", "vocab_size")


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_values(tmp_path, raw, bad):
    t = dict(raw)
    t["w2.weight"] = t["w2.weight"].copy()
    t["w2.weight"][3, 1] = bad
    src = write_folder(tmp_path / "src", prefixed(t), config=hf_config())
    refuse(src, tmp_path / "out", r"non-finite.*xpress_head.w2.weight \(1 of")


def test_already_folded_mixer(tmp_path, raw):
    folded = dict(raw)
    folded["mix.L"] = (raw["mix.L"] * np.tril(np.ones((B, B))) + np.eye(B)).astype(np.float32)
    assert mixer_looks_folded(folded["mix.L"]) and not mixer_looks_folded(raw["mix.L"])
    # A raw mixer whose upper triangle is exactly zero is still raw (its diagonal sits near 0) ...
    assert not mixer_looks_folded((raw["mix.L"] * np.tril(np.ones((B, B)))).astype(np.float32))
    # ... and the serving module's "no weights" identity mixer looks folded.
    assert mixer_looks_folded(np.broadcast_to(np.eye(B, dtype=np.float32), (R, B, B)))
    src = write_folder(tmp_path / "src", prefixed(folded), config=hf_config())
    assert "ALREADY FOLDED" in inspect_path(src)["mixer"]
    msg = refuse(src, tmp_path / "out", "looks ALREADY FOLDED")
    assert "--mixer folded" in msg and "--mixer raw" in msg
    # --mixer folded: stored as is, so the head equals the one converted from the raw mixer.
    convert_checkpoint(src, tmp_path / "out", mixer="folded")
    _, params = xj.load_params(tmp_path / "out")
    np.testing.assert_array_equal(jax_tokens(params, CFG, 0), reference_tokens(raw, 0))
    np.testing.assert_array_equal(np.asarray(params["mix"]), folded["mix.L"].transpose(1, 2, 0))
    # --mixer raw folds again (as asked) with a warning: 1 more on the diagonal.
    report = convert_checkpoint(src, tmp_path / "out2", mixer="raw")
    assert any("looks already folded" in w for w in report.warnings)
    _, p2 = xj.load_params(tmp_path / "out2")
    twice = (folded["mix.L"] * np.tril(np.ones((B, B))) + np.eye(B)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(p2["mix"]), twice.transpose(1, 2, 0))
    # --mixer folded on a raw mixer is refused.
    src_raw = write_folder(tmp_path / "src_raw", prefixed(raw), config=hf_config())
    refuse(src_raw, tmp_path / "out3", r"not a folded\s+mixer", mixer="folded")


def _corrupt(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    n = struct.unpack("<Q", data[:8])[0]
    if how == "truncated":
        path.write_bytes(bytes(data[: len(data) - 100]))
    elif how == "tiny":
        path.write_bytes(bytes(data[:5]))
    elif how == "header_len":
        path.write_bytes(struct.pack("<Q", len(data) * 4) + bytes(data[8:]))
    elif how == "json":
        data[8 + 1 : 8 + 12] = b"!!garbage!!"
        path.write_bytes(bytes(data))
    elif how == "offsets":
        header = json.loads(data[8 : 8 + n])
        key = next(k for k in header if k != "__metadata__")
        header[key]["data_offsets"][1] += 4
        blob = json.dumps(header).encode()
        blob += b" " * (-len(blob) % 8)
        path.write_bytes(struct.pack("<Q", len(blob)) + blob + bytes(data[8 + n :]))
    elif how == "trailing":
        path.write_bytes(bytes(data) + b"\0" * 16)


@pytest.mark.parametrize(
    "how,match",
    [
        ("truncated", "truncated"),
        ("tiny", "too short"),
        ("header_len", "header length"),
        ("json", "not valid JSON"),
        ("offsets", "needs .* bytes but data_offsets span"),
        ("trailing", "trailing bytes"),
    ],
)
def test_corrupt_safetensors(tmp_path, raw, how, match):
    src = write_folder(tmp_path / "src", prefixed(raw), config=hf_config())
    _corrupt(src / "model.safetensors", how)
    with pytest.raises(SafetensorsError, match=match) as exc:  # a ConversionError: exit code 2
        convert_checkpoint(src, tmp_path / "out")
    assert "model.safetensors" in str(exc.value)
    assert_no_dst(tmp_path / "out")


def test_safetensors_reader_matches_the_reference_library(tmp_path, raw):
    tensors = {**raw, "bf": raw["w2.weight"].astype(ml_dtypes.bfloat16), "i": np.arange(7, dtype=np.int64), "e": np.zeros((0, 3), np.float16)}
    save_file(tensors, tmp_path / "a.safetensors", metadata={"format": "pt"})
    back = load_file(tmp_path / "a.safetensors")
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape
        np.testing.assert_array_equal(back[k], v)
    assert SafetensorsFile(tmp_path / "a.safetensors").metadata == {"format": "pt"}
    st = pytest.importorskip("safetensors.numpy")
    plain = {k: v for k, v in tensors.items() if k != "bf"}
    theirs = st.load_file(str(tmp_path / "a.safetensors"))
    for k, v in plain.items():
        np.testing.assert_array_equal(theirs[k], v)
    st.save_file(plain, str(tmp_path / "b.safetensors"))
    mine = load_file(tmp_path / "b.safetensors")
    for k, v in plain.items():
        np.testing.assert_array_equal(mine[k], v)


def test_pickle_that_runs_code_is_refused(tmp_path, raw):
    marker = tmp_path / "PWNED"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(hf_config()))
    if HAS_TORCH:
        import torch

        from xpress_jax.convert.torch_reference import to_torch

        torch.save({**{k: to_torch(v) for k, v in prefixed(raw).items()}, "evil": Evil()}, src / "pytorch_model.bin")
        msg = refuse(src, tmp_path / "out", "refusing .*weights_only=True")
        assert "nothing in it was executed" in msg
        # A plain (non-zip) pickle is refused the same way.
        (src / "pytorch_model.bin").write_bytes(pickle.dumps({"x": Evil()}))
        refuse(src, tmp_path / "out", "refusing")
    else:
        (src / "pytorch_model.bin").write_bytes(pickle.dumps({"x": Evil()}))
        refuse(src, tmp_path / "out", "needs torch")
    assert not marker.exists()


@pytest.mark.parametrize("name", ["../outside.safetensors", "/tmp/outside.safetensors", "sub/../../outside.safetensors", "..\\outside.safetensors"])
def test_sharded_index_pointing_outside_src(tmp_path, raw, name):
    src = write_folder(tmp_path / "src", prefixed(raw), config=hf_config(), shards=2)
    save_file({"xpress_head.w1.weight": raw["w1.weight"]}, tmp_path / "outside.safetensors")
    index = src / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"]["xpress_head.w1.weight"] = name
    index.write_text(json.dumps(data))
    msg = refuse(src, tmp_path / "out", "points outside the source folder")
    assert repr(name) in msg


def test_sharded_index_disagrees_with_shards(tmp_path, raw):
    src = write_folder(tmp_path / "src", prefixed(raw), config=hf_config(), shards=2)
    index = src / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"]["xpress_head.nope"] = next(iter(data["weight_map"].values()))
    index.write_text(json.dumps(data))
    refuse(src, tmp_path / "out", "index and shards disagree")
    data["weight_map"]["xpress_head.nope"] = "missing.safetensors"
    index.write_text(json.dumps(data))
    refuse(src, tmp_path / "out", "does not exist")


def test_dst_exists_without_force(tmp_path, raw):
    src = write_folder(tmp_path / "src", prefixed(raw), config=hf_config())
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    with pytest.raises(ConversionError, match="already exists; pass --force"):
        convert_checkpoint(src, dst)
    assert (dst / "keep.txt").read_text() == "mine"
    convert_checkpoint(src, dst, force=True)
    assert not (dst / "keep.txt").exists() and xj.load_params(dst)[0] == CFG
    # DST that is the source folder is refused even with --force.
    with pytest.raises(ConversionError, match="is or contains the source"):
        convert_checkpoint(src, src, force=True)
    assert (src / "model.safetensors").exists()


def test_exception_while_writing_leaves_nothing(tmp_path, raw, monkeypatch):
    import xpress_jax.convert.convert as cc

    real = cc.write_checkpoint

    def boom(path, *a, **kw):
        real(path, *a, **kw)  # the checkpoint is complete in the staging folder ...
        raise RuntimeError("disk on fire")  # ... and then the write fails

    monkeypatch.setattr(cc, "write_checkpoint", boom)
    src = write_folder(tmp_path / "src", prefixed(raw), config=hf_config())
    with pytest.raises(RuntimeError, match="disk on fire"):
        convert_checkpoint(src, tmp_path / "out")
    assert_no_dst(tmp_path / "out")
    # With --force over an existing DST, the old one survives a failed write.
    monkeypatch.setattr(cc, "write_checkpoint", real)
    convert_checkpoint(src, tmp_path / "old")
    monkeypatch.setattr(cc, "write_checkpoint", boom)
    with pytest.raises(RuntimeError, match="disk on fire"):
        convert_checkpoint(src, tmp_path / "old", force=True, dtype="bfloat16")
    assert xj.load_params(tmp_path / "old")[1]["w1"].dtype == jnp.float32
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


# ----------------------------------------------------------------------------- the xPress release's training checkpoint

needs_torch = pytest.mark.skipif(not HAS_TORCH, reason="torch not installed")


class Custom:  # a global that weights_only=True does not allow
    pass


class Evil:
    marker = None

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def save_release(path: Path, tensors: dict, *, step=1234, **args) -> Path:
    """``torch.save`` of a trained refiner the way the release's training code writes it."""
    import argparse

    import torch

    from xpress_jax.convert.torch_reference import to_torch

    ns = argparse.Namespace(markov_rank=R, mlp_ratio=M // R, no_residual=True, no_sublayer_norm=True,
                            no_mix_out=True, input_mode="concat", lr=3e-4, data="train.jsonl")
    vars(ns).update(args)
    sd = {**{k: to_torch(v) for k, v in tensors.items()}, "mix.tril": torch.tril(torch.ones(B, B))}
    torch.save({"refiner_state_dict": sd, "args": ns, "global_step": step}, path)
    return path


@needs_torch
def test_release_checkpoint_converts_and_refines_like_the_reference(tmp_path, raw, capsys):
    src = save_release(tmp_path / "refiner.pt", raw)
    report = convert_checkpoint(src, tmp_path / "out", overrides=dict(topc=TOPC, num_passes=K, max_num_reqs=16))
    assert report.config == CFG and report.config_from == "the tensor shapes + flags"
    assert "xPress release training checkpoint (global_step 1234)" in report.source and report.prefixes == [""]
    _, params = xj.load_params(tmp_path / "out")
    for topc in (0, TOPC):
        np.testing.assert_array_equal(jax_tokens(params, CFG, topc), reference_tokens(raw, topc))
    assert main(["inspect", str(src)]) == 0
    out = capsys.readouterr().out
    for needle in ("xPress release training checkpoint (global_step 1234)", "no_residual=True, no_sublayer_norm=True",
                   "absent : markov_only, no_hidden", "markov_rank=16, mlp_ratio=2", f"V={V} H={H} B={B} r={R} M={M}",
                   "from the tensor shapes", "status : convertible"):
        assert needle in out, needle


@needs_torch
@pytest.mark.parametrize("flag,value,must", [("no_mlp", True, False), ("no_residual", False, True),
                                             ("input_mode", "sum", "concat"), ("lowrank_base_rank", 64, 0)])
def test_release_variant_not_served_is_refused(tmp_path, raw, capsys, flag, value, must):
    src = save_release(tmp_path / "refiner.pt", raw, **{flag: value})
    assert main([str(src), str(tmp_path / "out"), "-q"]) == 2
    assert f"{flag}={value!r} (must be {must!r})" in capsys.readouterr().err
    assert_no_dst(tmp_path / "out")
    assert main(["inspect", str(src)]) == 0
    out = capsys.readouterr().out
    assert f"{flag}={value!r}" in out and "PROBLEMS" in out and "does not serve" in out


@needs_torch
@pytest.mark.parametrize("args,match", [
    (dict(markov_rank=2 * R), rf"markov_rank={2 * R}.*w1.weight \({V}, {R}\) \(rank {R}\)"),
    (dict(mlp_ratio=4), rf"mlp hidden {4 * R}\).*mlp.gate_proj.weight \({M}, {R}\) \(mlp hidden {M}\)"),
], ids=["markov_rank", "mlp_ratio"])
def test_release_args_that_disagree_with_the_tensors(tmp_path, raw, args, match):
    refuse(save_release(tmp_path / "refiner.pt", raw, **args), tmp_path / "out", match)


@needs_torch
@pytest.mark.parametrize("extra", ["custom", "os.system"])
def test_release_with_another_global_is_refused(tmp_path, raw, capsys, extra):
    Evil.marker = tmp_path / "PWNED"
    src = save_release(tmp_path / "refiner.pt", raw, hook=Custom() if extra == "custom" else Evil())
    assert main([str(src), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "weights_only=True" in err and "nothing in it was executed" in err
    assert ("Custom" if extra == "custom" else "system") in err
    assert not Evil.marker.exists()
    assert_no_dst(tmp_path / "out")


@needs_torch
def test_release_without_args_is_refused(tmp_path, raw):
    import torch

    from xpress_jax.convert.torch_reference import to_torch

    torch.save({"refiner_state_dict": {k: to_torch(v) for k, v in raw.items()}, "global_step": 5}, tmp_path / "r.pt")
    refuse(tmp_path / "r.pt", tmp_path / "out", "has no 'args'")


def test_config_json_candidate_topc_alias(tmp_path, raw):
    cfg = {k: v for k, v in hf_config().items() if k != "xpress_topc"}
    src = write_folder(tmp_path / "src", prefixed(raw), config={**cfg, "xpress_candidate_topc": TOPC})
    assert convert_checkpoint(src, tmp_path / "out").config == CFG
    (src / "config.json").write_text(json.dumps({**cfg, "xpress_candidate_topc": TOPC, "xpress_topc": TOPC}))
    assert inspect_path(src)["head_config"]["topc"] == TOPC
    (src / "config.json").write_text(json.dumps({**cfg, "xpress_candidate_topc": TOPC, "xpress_topc": 2 * TOPC}))
    refuse(src, tmp_path / "out2", f"xpress_topc={2 * TOPC} and xpress_candidate_topc={TOPC} disagree")


# ----------------------------------------------------------------------------- CLI


def run_cli(*args, cwd=None):
    """The installed ``xpress-convert`` console script when this venv has it, else ``python -m convert``."""
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), JAX_PLATFORMS="cpu")
    script = Path(sys.executable).parent / "xpress-convert"
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "xpress_jax.convert"]
    return subprocess.run([*cmd, *map(str, args)], capture_output=True, text=True, env=env, cwd=cwd, timeout=120)


@pytest.mark.slow
def test_cli_convert_verify_and_inspect(tmp_path, raw, capsys):
    src = write_folder(tmp_path / "src", {**backbone(), **prefixed(raw, "model.xpress_head.")}, config=hf_config(), shards=2)
    dst = tmp_path / "out"
    res = run_cli(src, dst, "--verify", "--verify-n", "8")
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "9 tensors under 'model.xpress_head.'" in out and "10 backbone tensor(s)" in out
    assert "full-vocab: 56/56 draft tokens identical (100.00%)" in out
    assert f"top-C({TOPC}): 56/56 draft tokens identical (100.00%)" in out
    assert ("PyTorch reference" if HAS_TORCH else "jnp path") in out
    assert "bitwise identical" in out

    assert main(["inspect", str(src)]) == 0
    out = capsys.readouterr().out
    for needle in (
        "model.xpress_head.mix.L",
        "(16, 8, 8)",
        "raw (the converter folds it once)",
        "backbone (ignored): 10 tensors",
        "model.layers.*",
        "status : convertible",
    ):
        assert needle in out, needle

    res = run_cli("inspect", dst, "--json")
    assert res.returncode == 0, res.stderr
    info = json.loads(res.stdout)
    assert info["kind"] == "orbax" and info["dtype"] == "float32"
    assert xj.HeadConfig(**info["config"]) == CFG
    assert info["params"]["mix"] == {"shape": [B, B, R], "dtype": "float32"}
    assert info["metadata"]["source_keys"]["mix.L"] == "model.xpress_head.mix.L"

    # DST exists -> exit 2, clear message, DST untouched.
    assert main([str(src), str(dst)]) == 2
    assert "already exists; pass --force" in capsys.readouterr().err
    assert xj.load_params(dst)[0] == CFG


def test_cli_exit_codes_in_process(tmp_path, raw, monkeypatch, capsys):
    src = write_folder(tmp_path / "src", prefixed({k: v for k, v in raw.items() if k != "w2.weight"}), config=hf_config())
    assert main([str(src), str(tmp_path / "out"), "-q"]) == 2
    assert "xpress_head.w2.weight" in capsys.readouterr().err
    assert_no_dst(tmp_path / "out")
    assert main([]) == 2  # usage
    assert main(["inspect", str(tmp_path / "missing")]) == 2

    # inspect lists problems without failing.
    assert main(["inspect", str(src)]) == 0
    assert "missing head tensor(s): 'xpress_head.w2.weight'" in capsys.readouterr().out

    # A verify mismatch exits 1 and writes nothing: corrupt the jnp reference's params.
    import xpress_jax.convert.verify as cv

    good = write_folder(tmp_path / "good", prefixed(raw), config=hf_config())
    real = cv.params_from_state_dict
    monkeypatch.setattr(cv, "params_from_state_dict", lambda t, c, dtype: {**real(t, c, dtype=dtype), "w2": -real(t, c, dtype=dtype)["w2"]})
    assert main(["convert", str(good), str(tmp_path / "out"), "--verify", "--reference", "jnp", "-q"]) == 1
    assert "verification failed" in capsys.readouterr().err
    assert_no_dst(tmp_path / "out")
    monkeypatch.setattr(cv, "params_from_state_dict", real)
    assert main([str(good), str(tmp_path / "out"), "--verify", "--reference", "jnp", "-q", "--dtype", "bfloat16"]) == 0
    assert "reported, not required" in capsys.readouterr().out


def test_converted_checkpoint_as_source_says_so(tmp_path, raw, capsys):
    src = write_folder(tmp_path / "src", prefixed(raw), config=hf_config())
    convert_checkpoint(src, tmp_path / "ckpt")
    msg = refuse(tmp_path / "ckpt", tmp_path / "again", "already converted")
    assert "load_params" in msg and "xpress-convert inspect" in msg
    refuse(tmp_path / "ckpt" / "params", tmp_path / "again", "inside an already converted")
    assert main([str(tmp_path / "ckpt"), str(tmp_path / "again")]) == 2
    assert "already converted" in capsys.readouterr().err


def test_dst_inside_src_is_refused_and_nothing_is_written(tmp_path, raw, capsys):
    src = write_folder(tmp_path / "src", prefixed(raw), config=hf_config())
    before = sorted(p.relative_to(src) for p in src.rglob("*"))
    for force in (False, True):
        refuse(src, src / "sub", "lies inside the source folder", force=force)
    assert main([str(src), str(src / "sub" / "deeper"), "-q"]) == 2
    assert "inside the source folder" in capsys.readouterr().err
    assert sorted(p.relative_to(src) for p in src.rglob("*")) == before
