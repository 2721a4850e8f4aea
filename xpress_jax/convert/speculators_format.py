"""XPress models saved by vLLM's ``speculators`` library (``XPressDraftModel.save_pretrained``).

Its ``config.json`` carries ``speculators_model_type: "xpress"``; the head's sizes are spread over the
speculators fields (`speculators_hf_config` reads them into the ``config.json`` names `HeadConfig.from_hf_config`
reads). Its weights: the DFlash backbone, the head under ``refiner_head.`` with `sources.SPECULATORS_KEY_MAP`
names, and, for a reduced draft vocabulary, ``d2t`` [V_draft] int64 and ``t2d`` [V] bool at the top level.
Its heads are trained with slot 0's predecessor the real token before the anchor (``predecessor="previous"``)
and score the whole draft vocabulary (``topc`` 0 unless ``--topc``).
"""

from __future__ import annotations

from typing import Any, Mapping

from .errors import ConversionError

__all__ = ["SPECULATORS_DEFAULTS", "is_speculators_config", "speculators_hf_config"]

#: The ``XPressSpeculatorConfig`` defaults (speculators 0.9.0) of the fields read here, used when a field is absent.
SPECULATORS_DEFAULTS = {"block_size": 8, "xpress_rank": 256, "xpress_mlp_ratio": 2, "num_jacobi_passes": 6,
                        "draft_vocab_size": 32000, "sample_from_anchor": False}


def is_speculators_config(config: Any) -> bool:
    """Whether a parsed config.json was written by the speculators library (any model type)."""
    return isinstance(config, Mapping) and "speculators_model_type" in config


def speculators_hf_config(config: Mapping[str, Any], where: str) -> tuple[dict, list[str]]:
    """The ``config.json`` fields `HeadConfig.from_hf_config` reads, from a speculators XPress config, and the
    speculators fields they came from (``"field=value"``, for the summary). Raises `ConversionError` for another
    speculators model type, ``sample_from_anchor: true`` or missing sizes."""
    kind = config.get("speculators_model_type")
    if kind != "xpress":
        raise ConversionError(f"{where}: speculators_model_type={kind!r}: a speculators model without an XPress "
                              "refiner head (only 'xpress' models carry one)")
    if config.get("sample_from_anchor", False):
        raise ConversionError(
            f"{where}: sample_from_anchor={config['sample_from_anchor']!r}: the head was trained with every slot "
            "predicting the next token (the DSpark layout); xpress-jax serves the fill-in layout only (slot 0 is "
            "the anchor, slots 1..B-1 are drafted), as vLLM's XPress drafter does")
    tl = config.get("transformer_layer_config")
    if not isinstance(tl, Mapping):
        raise ConversionError(f"{where}: no 'transformer_layer_config' object: it gives the head's vocabulary "
                              "(vocab_size) and hidden size (hidden_size)")
    for key in ("vocab_size", "hidden_size"):
        if key not in tl:
            raise ConversionError(f"{where}: transformer_layer_config has no {key!r}; it is required to size the head")

    def get(key: str) -> Any:
        return config.get(key, SPECULATORS_DEFAULTS[key])

    rank, ratio = get("xpress_rank"), get("xpress_mlp_ratio")
    if isinstance(rank, bool) or isinstance(ratio, bool) or not isinstance(rank, int) or not isinstance(ratio, int):
        raise ConversionError(f"{where}: xpress_rank={rank!r} and xpress_mlp_ratio={ratio!r} must be ints")
    hf = {"vocab_size": tl["vocab_size"], "hidden_size": tl["hidden_size"], "xpress_block_size": get("block_size"),
          "xpress_rank": rank, "xpress_mlp_hidden": rank * ratio, "xpress_topc": 0,
          "xpress_num_passes": get("num_jacobi_passes"), "draft_vocab_size": get("draft_vocab_size"),
          "xpress_predecessor": "previous"}
    if "max_num_seqs" in config:
        hf["max_num_seqs"] = config["max_num_seqs"]

    def shown(key: str, value: Any, what: str) -> str:
        return f"{key}={value!r} ({what}{'' if key.rsplit('.', 1)[-1] in config or '.' in key else ', its default'})"

    fields = [shown("transformer_layer_config.vocab_size", tl["vocab_size"], "V"),
              shown("transformer_layer_config.hidden_size", tl["hidden_size"], "H"),
              shown("block_size", get("block_size"), "B"), shown("xpress_rank", rank, "r"),
              shown("xpress_mlp_ratio", ratio, f"M = {rank} x {ratio}"),
              shown("num_jacobi_passes", get("num_jacobi_passes"), "K"),
              shown("draft_vocab_size", get("draft_vocab_size"), "V_draft"),
              shown("sample_from_anchor", get("sample_from_anchor"), "fill-in layout")]
    if "target_hidden_size" in config:
        fields.append(f"target_hidden_size={config['target_hidden_size']!r} (the verifier's; not the head's H)")
    return hf, fields
