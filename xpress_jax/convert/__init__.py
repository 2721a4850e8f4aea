"""PyTorch XPress checkpoints (the files vLLM loads, the xPress release's training checkpoint) -> Orbax.

``convert_checkpoint("drafter/", "head_ckpt/", verify=True)`` converts (a report comes back) and
``xpress_jax.load_params("head_ckpt/")`` restores the head. Command line: ``xpress-convert SRC DST``
and ``xpress-convert inspect PATH`` (`cli`); also ``python -m xpress_jax.convert``.
"""

from .convert import ConvertReport, convert_checkpoint, mixer_looks_folded, resolve_config
from .errors import ConversionError, VerificationError
from .inspection import format_inspect, inspect_path
from .safetensors_io import SafetensorsError, SafetensorsFile, load_file, save_file
from .sources import HEAD_PREFIXES, open_source, select_head

__all__ = [
    "HEAD_PREFIXES", "ConversionError", "ConvertReport", "SafetensorsError", "SafetensorsFile", "VerificationError",
    "convert_checkpoint", "format_inspect", "inspect_path", "load_file", "mixer_looks_folded", "open_source",
    "resolve_config", "save_file", "select_head",
]
