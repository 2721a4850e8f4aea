"""``xpress-convert``: PyTorch XPress checkpoints -> Orbax, and ``xpress-convert inspect``.

Usage::

    xpress-convert SRC DST [--dtype keep|bfloat16|float32] [--force] [--verify] [--config config.json]
    xpress-convert inspect PATH [--json]

(``xpress-convert convert SRC DST ...`` is the same as the first form.)

Exit codes: 0 success; 1 ``--verify`` found tokens that must be identical and
are not; 2 bad input or usage (the message says what); 3 an unexpected error.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback
from typing import Sequence

__all__ = ["main"]

EXIT_OK, EXIT_VERIFY, EXIT_BAD_INPUT, EXIT_INTERNAL = 0, 1, 2, 3

_SIZE_FLAGS = (
    ("--vocab-size", "vocab_size", "V"),
    ("--hidden-size", "hidden_size", "H, the drafter's hidden size"),
    ("--block-size", "block_size", "B (config.json: xpress_block_size, else num_speculative_steps + 1)"),
    ("--rank", "rank", "r (xpress_rank)"),
    ("--mlp-hidden", "mlp_hidden", "M (xpress_mlp_hidden)"),
    ("--topc", "topc", "C (xpress_topc; 0 = full vocabulary)"),
    ("--num-passes", "num_passes", "K (xpress_num_passes)"),
    ("--max-num-reqs", "max_num_reqs", "largest N per call (vLLM: max_num_seqs)"),
)


def _convert_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="xpress-convert",
        description=(
            "Convert the XPress refiner head of a PyTorch checkpoint (the files vLLM loads) into an Orbax "
            "checkpoint that xpress_jax.load_params(DST) restores."
        ),
        epilog=(
            "Also: `xpress-convert inspect PATH [--json]` lists the keys, shapes, dtypes and config of a source "
            "or converted checkpoint. Exit codes: 0 ok, 1 --verify mismatch, 2 bad input/usage, 3 internal error."
        ),
    )
    p.add_argument("src", metavar="SRC", help="folder (config.json + *.safetensors / index / pytorch_model.bin / *.pt) or one file")
    p.add_argument("dst", metavar="DST", help="Orbax checkpoint folder to create")
    p.add_argument("--dtype", choices=("keep", "bfloat16", "float32"), default="keep", help="stored dtype (default: keep the source's)")
    p.add_argument("--force", action="store_true", help="replace DST if it exists (only after the new one is complete)")
    p.add_argument("--verify", action="store_true", help="compare refine tokens with a reference built from the source tensors")
    p.add_argument("--config", metavar="CONFIG_JSON", help="config.json to size the head (default: SRC/config.json)")
    p.add_argument(
        "--mixer",
        choices=("auto", "raw", "folded"),
        default="auto",
        help="mix.L in the source: raw (fold it once), folded (store as is); auto refuses one that looks folded",
    )
    p.add_argument("--prefix", help="key prefix of the head (default: 'xpress_head.' or 'model.xpress_head.'; '' = bare names)")
    for flag, dest, what in _SIZE_FLAGS:
        p.add_argument(flag, dest=dest, type=int, metavar="N", help=f"override {what}")
    p.add_argument("--verify-n", type=int, default=4, metavar="N", help="blocks per verify call (default 4)")
    p.add_argument("--seed", type=int, default=0, help="seed of the verify inputs")
    p.add_argument(
        "--reference",
        choices=("auto", "torch", "jnp"),
        default="auto",
        help="verify reference: PyTorch port (auto when torch is installed) or jnp path from the source tensors",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars, no warnings (the summary still prints)")
    return p


def _inspect_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="xpress-convert inspect",
        description="Keys, shapes, dtypes and config of a source checkpoint or a converted Orbax one (read-only).",
    )
    p.add_argument("path", metavar="PATH")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--config", metavar="CONFIG_JSON", help="config.json to check the head shapes against")
    p.add_argument("--prefix", help="key prefix of the head")
    return p


def _quiet_libraries() -> None:
    for name in ("absl", "orbax", "jax._src.xla_bridge"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        from absl import logging as absl_logging

        absl_logging.set_verbosity(absl_logging.ERROR)
    except ImportError:
        pass


def _err(msg: str) -> None:
    print(f"xpress-convert: error: {msg}", file=sys.stderr)


def _run_inspect(argv: list[str]) -> int:
    args = _inspect_parser().parse_args(argv)
    from .errors import ConversionError
    from .inspection import format_inspect, inspect_path, to_json

    try:
        info = inspect_path(args.path, config=args.config, prefix=args.prefix)
    except ConversionError as e:
        _err(str(e))
        return EXIT_BAD_INPUT
    print(to_json(info) if args.json else format_inspect(info))
    return EXIT_OK


def _run_convert(argv: list[str]) -> int:
    args = _convert_parser().parse_args(argv)
    from .convert import convert_checkpoint
    from .errors import ConversionError, VerificationError

    overrides = {dest: getattr(args, dest) for _, dest, _ in _SIZE_FLAGS if getattr(args, dest) is not None}
    log = (lambda _m: None) if args.quiet else (lambda m: print(m, file=sys.stderr))
    try:
        report = convert_checkpoint(
            args.src,
            args.dst,
            dtype=args.dtype,
            force=args.force,
            verify=args.verify,
            config=args.config,
            overrides=overrides,
            mixer=args.mixer,
            prefix=args.prefix,
            verify_n=args.verify_n,
            seed=args.seed,
            reference=args.reference,
            progress=not args.quiet,
            log=log,
        )
    except VerificationError as e:
        _err(str(e))
        return EXIT_VERIFY
    except ConversionError as e:
        _err(str(e))
        return EXIT_BAD_INPUT
    except OSError as e:
        _err(f"{e} (nothing was written to {args.dst})")
        return EXIT_BAD_INPUT
    print("\n".join(report.lines()))
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``xpress-convert``; returns the exit code (the console script exits with it)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    _quiet_libraries()
    try:
        if argv and argv[0] == "inspect":
            return _run_inspect(argv[1:])
        if argv and argv[0] == "convert":
            argv = argv[1:]
        return _run_convert(argv)
    except SystemExit as e:  # argparse: --help (0) or a usage error (2)
        return int(e.code or 0) if isinstance(e.code, int) else EXIT_BAD_INPUT
    except BrokenPipeError:  # output piped into `head`: the work is done, stop quietly
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except OSError:
            pass
        return EXIT_OK
    except KeyboardInterrupt:
        _err("interrupted; nothing was written")
        return 130
    except Exception:
        traceback.print_exc()
        _err("internal error (a bug: please report it with the traceback above)")
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
