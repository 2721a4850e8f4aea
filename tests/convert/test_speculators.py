"""XPress models saved by vLLM's ``speculators`` library, converted with ``xpress-convert``.

The sources are built here with speculators' own classes (`XPressDraftModel` with a tiny Qwen3 layer config,
``save_pretrained``), and the oracle is speculators' own `XPressRefinerHead`: the Jacobi loop of its training
forward (``pred = d2t-map(argmax(base + refiner_head.block_bias(prev, hcache)))`` per pass, slot 0 held at the
anchor, slot 0's predecessor the token before the anchor), run in float64. `xj.refine` on the converted head
must give its tokens for K = 0, 1, 3, with the real previous token and with the anchor standing in for it, over
the whole vocabulary and over a reduced draft vocabulary (a shuffled ``d2t``). Also: sharded safetensors, the
``model.refiner_head.`` prefix, bad vocabulary maps, ``sample_from_anchor: true``, and a PyTorch ``.pt`` whose
tensors sit one level down (``{"model": state_dict}``) or that comes without a ``config.json``.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

# CI's speculators stage sets XPRESS_REQUIRE_SPECULATORS=1: there a failed import fails instead of skipping.
_REQUIRED = os.environ.get("XPRESS_REQUIRE_SPECULATORS") == "1"
torch = (importlib.import_module("torch") if _REQUIRED
         else pytest.importorskip("torch", reason="needs torch: speculators is a PyTorch library"))


def _without_broken_extensions() -> None:
    """transformers imports torchvision and torchaudio when they are installed; a build that does not match torch
    (its compiled operators fail to load) would fail every import of speculators. Such a package is hidden here, as
    if absent: speculators' XPress model needs neither."""
    for name in ("torchvision", "torchaudio"):
        if name in sys.modules:
            continue
        try:
            __import__(name)
        except ImportError:
            pass
        except Exception:  # noqa: BLE001 - RuntimeError/OSError from the package's compiled extension
            for k in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
                del sys.modules[k]
            sys.modules[name] = None  # type: ignore[assignment]  # find_spec -> None, import -> ImportError


_without_broken_extensions()
speculators = (importlib.import_module("speculators") if _REQUIRED
               else pytest.importorskip("speculators", reason="needs speculators (and torch)"))

from speculators.models.xpress import XPressDraftModel, XPressSpeculatorConfig  # noqa: E402
from transformers.models.qwen3.modeling_qwen3 import Qwen3Config  # noqa: E402

import xpress_jax as xj  # noqa: E402
from xpress_jax.convert import load_file, save_file  # noqa: E402
from xpress_jax.convert.cli import main  # noqa: E402

refine = jax.jit(xj.refine, static_argnames=xj.STATIC_ARGNAMES)  # one compile per K and vocabulary
V, VD, H, B, R, RATIO, K_CFG = 64, 40, 16, 6, 8, 2, 3
N = 24
# Refiner weights large enough that refinement changes a good share of the drafter's tokens.
STD = {"token_embed.weight": 0.6, "readout.weight": 0.5, "mix_l": 0.4}


def build_model(draft_vocab: int, seed: int) -> "XPressDraftModel":
    """A tiny XPressDraftModel from speculators' own classes: random refiner weights (the raw mixer's upper
    triangle too, which its tril mask must hide), float64, and for a reduced vocabulary a shuffled d2t/t2d."""
    tl = Qwen3Config(vocab_size=V, hidden_size=H, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=8)
    cfg = XPressSpeculatorConfig(transformer_layer_config=tl, draft_vocab_size=draft_vocab, block_size=B,
                                 xpress_rank=R, xpress_mlp_ratio=RATIO, num_jacobi_passes=K_CFG,
                                 aux_hidden_state_layer_ids=[0], target_hidden_size=3 * H)
    torch.manual_seed(seed)
    model = XPressDraftModel(cfg)
    with torch.no_grad():
        for name, p in model.refiner_head.named_parameters():
            p.normal_(0.0, STD.get(name, 0.3))
    if draft_vocab < V:
        g = torch.Generator().manual_seed(seed + 1)
        ids = torch.randperm(V, generator=g)[:draft_vocab]  # shuffled: draft order != verifier order
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[ids] = True
        model.load_vocab_mappings(t2d, ids - torch.arange(draft_vocab))
    return model.double().eval()


def speculators_loop(model, logits, h, anchors, prev, K: int) -> np.ndarray:
    """K Jacobi passes of speculators' refiner head, as its training forward runs them (its consistency rounds):
    seed = the drafter's argmax mapped to verifier ids; each pass slot 0 = anchor, prev = [prev, block[:-1]],
    pick = argmax over the draft vocabulary of base + block_bias (first index on ties), mapped with d2t."""
    head = model.refiner_head
    logits, h = torch.from_numpy(logits), torch.from_numpy(h)
    anchors, prev = torch.from_numpy(anchors).long(), torch.from_numpy(prev).long()
    with torch.no_grad():
        hcache = head.hidden_cache(h)
        pred = model._draft_to_verifier_ids(logits.argmax(dim=-1))
        for _ in range(K):
            pred[:, 0] = anchors
            prev_j = torch.cat([prev[:, None], pred[:, :-1]], dim=1)
            pred = model._draft_to_verifier_ids((logits + head.block_bias(prev_j, hcache=hcache)).argmax(dim=-1))
    return pred[:, 1:].numpy()


def inputs(vd: int, seed: int):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((N, B, vd)), rng.standard_normal((N, B, H)),
            rng.integers(0, V, N).astype(np.int32), rng.integers(0, V, N).astype(np.int32))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Both models (full and reduced vocabulary), each saved by speculators' save_pretrained."""
    root = tmp_path_factory.mktemp("speculators")
    out = {}
    for name, vd, seed in (("full", V, 0), ("reduced", VD, 10)):
        model = build_model(vd, seed)
        model.save_pretrained(root / name)
        out[name] = (model, root / name)
    return out


def assert_no_dst(dst: Path) -> None:
    assert not dst.exists(), f"{dst} was left behind"
    assert not [p for p in dst.parent.iterdir() if p.name.startswith(f".{dst.name}.tmp-")], "temporary folder left"


def convert(src, dst, *args, capsys=None) -> str:
    with jax.enable_x64(True):  # float64 source -> a float64 checkpoint
        code = main([str(src), str(dst), "-q", *map(str, args)])
    out = capsys.readouterr() if capsys is not None else None
    assert code == 0, out.err if out else code
    return out.out if out else ""


# ----------------------------------------------------------------------------- the tokens


@pytest.mark.parametrize("vocab", ["full", "reduced"])
def test_refine_gives_the_speculators_heads_tokens(saved, tmp_path, capsys, vocab):
    model, src = saved[vocab]
    vd = V if vocab == "full" else VD
    summary = convert(src, tmp_path / "ckpt", capsys=capsys)
    with jax.enable_x64(True):
        head = xj.load_params(tmp_path / "ckpt")
        cfg = head.config
        assert (cfg.vocab_size, cfg.hidden_size, cfg.block_size, cfg.rank, cfg.mlp_hidden) == (V, H, B, R, R * RATIO)
        assert (cfg.draft_vocab_size, cfg.predecessor, cfg.topc, cfg.num_passes, cfg.max_num_reqs) == (
            vd, "previous", 0, K_CFG, 256)
        assert head.dtype == jnp.float64 and (("d2t" in head.params) == (vocab == "reduced"))
        logits, h, anchors, prev = inputs(vd, seed=3)
        agree, total, changed = 0, 0, 0
        drafter = speculators_loop(model, logits, h, anchors, prev, 0)
        for K in (0, 1, 3):
            wants = [speculators_loop(model, logits, h, anchors, p, K) for p in (prev, anchors)]
            if K:  # the two conventions really differ, so a refine that ignores prev_ids fails
                assert (wants[0] != wants[1]).any(axis=1).mean() > 0.3
            for p, want in zip((prev, anchors), wants):  # the real previous token; the anchor standing in for it
                got = np.asarray(refine(head, jnp.asarray(logits), jnp.asarray(h), jnp.asarray(anchors),
                                        jnp.asarray(p), num_passes=K, backend="xla"))
                agree, total = agree + int((got == want).sum()), total + want.size
                changed += int((want != drafter).sum()) if K == 3 else 0
                np.testing.assert_array_equal(got, want, err_msg=f"K={K}, prev={'real' if p is prev else 'anchor'}")
    print(f"\n{vocab}: {agree}/{total} tokens identical; K=3 changed {changed}/{2 * drafter.size} drafter tokens")
    assert changed > 0.3 * 2 * drafter.size, "the refiner barely changes tokens: the comparison would be weak"
    if vocab == "reduced":  # every token is a verifier id the draft vocabulary covers
        assert np.isin(want, np.nonzero(model.t2d.numpy())[0]).all()
        assert "d2t" in summary and "V_draft=40" in summary


def test_summary_names_the_fields_and_the_defaults(saved, tmp_path, capsys):
    _, src = saved["reduced"]
    out = convert(src, tmp_path / "ckpt", capsys=capsys)
    for needle in ("speculators xpress model (speculators", "V=64 H=16 B=6 r=8 M=16 topc=0 K=3 max_num_reqs=256 "
                   "V_draft=40 predecessor=previous", "transformer_layer_config.hidden_size=16 (H)",
                   "xpress_mlp_ratio=2 (M = 8 x 2)", "num_jacobi_passes=3 (K)", "draft_vocab_size=40",
                   "topc=0 (speculators scores the full draft vocabulary; --topc N sets it)",
                   "max_num_reqs=256", "--max-num-reqs N", "DEFAULTS", "9 tensors under 'refiner_head.'",
                   "40 draft ids -> verifier ids by d2t", "checked against t2d"):
        assert needle in out, (needle, out)
    assert main(["inspect", str(src)]) == 0
    out = capsys.readouterr().out
    for needle in ("refiner_head.mix_l", "(speculators names)", "d2t", "vocabulary map", "valid: 40 draft ids",
                   "sample_from_anchor=False", "status : convertible"):
        assert needle in out, (needle, out)
    # Flags win over the defaults (and say so no more).
    out = convert(src, tmp_path / "ckpt2", "--topc", 8, "--max-num-reqs", 16, capsys=capsys)
    assert "topc=8" in out and "max_num_reqs=16" in out and "DEFAULTS" not in out
    assert xj.load_params(tmp_path / "ckpt2").config.topc == 8


@pytest.mark.slow
def test_verify_on_a_speculators_folder(saved, tmp_path, capsys):
    _, src = saved["reduced"]
    out = convert(src, tmp_path / "ckpt", "--verify", "--verify-n", 8, "--topc", 12, capsys=capsys)
    assert "full-vocab: 40/40 draft tokens identical (100.00%)" in out, out
    assert "top-C(12): 40/40 draft tokens identical (100.00%)" in out, out


# ----------------------------------------------------------------------------- layouts of the files


def _params(path):
    with jax.enable_x64(True):
        head = xj.load_params(path)
        return head.config, {k: np.asarray(v) for k, v in head.params.items()}


def test_sharded_and_prefixed_folders_give_the_same_head(saved, tmp_path, capsys):
    model, src = saved["reduced"]
    convert(src, tmp_path / "single", capsys=capsys)
    want = _params(tmp_path / "single")
    model.save_pretrained(tmp_path / "sharded", max_shard_size="8KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    convert(tmp_path / "sharded", tmp_path / "from_sharded", capsys=capsys)
    # The whole model wrapped under "model." (the head at model.refiner_head., the maps at model.d2t / model.t2d).
    (tmp_path / "wrapped").mkdir()
    shutil.copy(src / "config.json", tmp_path / "wrapped" / "config.json")
    save_file({f"model.{k}": v for k, v in load_file(src / "model.safetensors").items()},
              tmp_path / "wrapped" / "model.safetensors")
    out = convert(tmp_path / "wrapped", tmp_path / "from_wrapped", capsys=capsys)
    assert "under 'model.refiner_head.'" in out and "by model.d2t" in out
    for dst in ("from_sharded", "from_wrapped"):
        cfg, params = _params(tmp_path / dst)
        assert cfg == want[0] and params.keys() == want[1].keys()
        for k in params:
            np.testing.assert_array_equal(params[k], want[1][k], err_msg=f"{dst}: {k}")


# ----------------------------------------------------------------------------- refused


def _rewrite(src: Path, dst: Path, *, tensors=None, config=None) -> Path:
    shutil.copytree(src, dst)
    if tensors is not None:
        save_file(tensors(load_file(dst / "model.safetensors")), dst / "model.safetensors")
    if config is not None:
        cfg = json.loads((dst / "config.json").read_text())
        config(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _bad_d2t(kind):
    def edit(t):
        d2t = t["d2t"].copy()
        if kind == "duplicate":
            d2t[1] = d2t[0] - 1  # draft id 1 lands on draft id 0's verifier id
        elif kind == "range":
            d2t[2] = V  # draft id 2 -> verifier id V + 2
        else:  # t2d disagrees
            t["t2d"] = np.roll(t["t2d"], 1)
        return {**t, "d2t": d2t}
    return edit


@pytest.mark.parametrize("kind,match", [("duplicate", "two draft ids to one verifier id"),
                                        ("range", r"maps draft ids \[2\] to verifier ids"),
                                        ("t2d", "t2d")])
def test_a_bad_vocabulary_map_is_refused(saved, tmp_path, capsys, kind, match):
    src = _rewrite(saved["reduced"][1], tmp_path / "src", tensors=_bad_d2t(kind))
    assert main([str(src), str(tmp_path / "out"), "-q"]) == 2
    err = capsys.readouterr().err
    assert "bad vocabulary map (d2t and t2d)" in err and re.search(match, err), err
    assert_no_dst(tmp_path / "out")
    assert main(["inspect", str(src)]) == 0
    assert "INVALID" in capsys.readouterr().out


def test_missing_d2t_and_sample_from_anchor_are_refused(saved, tmp_path, capsys):
    src = _rewrite(saved["reduced"][1], tmp_path / "no_map",
                   tensors=lambda t: {k: v for k, v in t.items() if k not in ("d2t", "t2d")})
    assert main([str(src), str(tmp_path / "out"), "-q"]) == 2
    err = capsys.readouterr().err
    assert "needs the draft-to-verifier map d2t [40]" in err, err
    assert_no_dst(tmp_path / "out")
    src = _rewrite(saved["full"][1], tmp_path / "anchor", config=lambda c: c.update(sample_from_anchor=True))
    assert main([str(src), str(tmp_path / "out"), "-q"]) == 2
    err = capsys.readouterr().err
    assert "sample_from_anchor=True" in err and "fill-in layout" in err, err
    assert_no_dst(tmp_path / "out")
    src = _rewrite(saved["full"][1], tmp_path / "dflash", config=lambda c: c.update(speculators_model_type="dflash"))
    assert main([str(src), str(tmp_path / "out"), "-q"]) == 2
    assert "speculators_model_type='dflash'" in capsys.readouterr().err


# ----------------------------------------------------------------------------- PyTorch .pt files


def test_pt_with_the_state_dict_one_level_down(saved, tmp_path, capsys):
    model, src = saved["reduced"]
    convert(src, tmp_path / "ref", capsys=capsys)
    want = _params(tmp_path / "ref")
    folder = tmp_path / "pt"
    folder.mkdir()
    shutil.copy(src / "config.json", folder / "config.json")
    torch.save({"model": model.state_dict(), "step": 7}, folder / "checkpoint.pt")
    out = convert(folder, tmp_path / "out", capsys=capsys)
    assert "tensors one level down under 'model'" in out, out
    cfg, params = _params(tmp_path / "out")
    assert cfg == want[0] and all(np.array_equal(params[k], want[1][k]) for k in params)

    # Two entries that each hold a head: refused, naming both and the --prefix of each; --prefix picks one.
    torch.save({"model": model.state_dict(), "ema": model.state_dict()}, folder / "checkpoint.pt")
    assert main([str(folder), str(tmp_path / "out2"), "-q"]) == 2
    err = capsys.readouterr().err
    assert "'model' (--prefix 'model.refiner_head.')" in err and "'ema' (--prefix 'ema.refiner_head.')" in err, err
    assert_no_dst(tmp_path / "out2")
    convert(folder, tmp_path / "out2", "--prefix", "ema.refiner_head.", capsys=capsys)
    assert _params(tmp_path / "out2")[0] == want[0]


def test_lone_pt_says_which_values_are_defaults(saved, tmp_path, capsys):
    model, _ = saved["reduced"]
    torch.save({"state_dict": model.state_dict()}, tmp_path / "head.pt")  # no config.json beside it
    out = convert(tmp_path / "head.pt", tmp_path / "out", capsys=capsys)
    assert "config from the tensor shapes" in out and "one level down under 'state_dict'" in out, out
    for needle in ("topc=0 (speculators scores the full draft vocabulary; --topc N sets it)",
                   "num_passes=6 (Jacobi passes K; --num-passes N sets it)",
                   "max_num_reqs=256 (the largest N per call; --max-num-reqs N sets it): DEFAULTS (no config.json)",
                   "predecessor='previous'"):
        assert needle in out, (needle, out)
    cfg = _params(tmp_path / "out")[0]
    assert (cfg.vocab_size, cfg.draft_vocab_size, cfg.predecessor, cfg.num_passes) == (V, VD, "previous", 6)
