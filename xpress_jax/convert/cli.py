"""``xpress-convert SRC DST [...]`` (also ``xpress-convert convert ...``) and ``xpress-convert inspect PATH``.

Exit codes: 0 success; 1 ``--verify`` found tokens that must be identical and are not; 2 bad input
or usage (the message says what); 3 an unexpected error.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback
from typing import Sequence

from .convert import DTYPES, MIXER_MODES, convert_checkpoint
from .errors import ConversionError, VerificationError
from .inspection import format_inspect, inspect_path, to_json

__all__ = ["main"]

EXIT_OK, EXIT_VERIFY, EXIT_BAD_INPUT, EXIT_INTERNAL = 0, 1, 2, 3
_SIZE_FLAGS = (
    ("--vocab-size", "vocab_size", "V"),
    ("--hidden-size", "hidden_size", "H, the drafter's hidden size"),
    ("--block-size", "block_size", "B (config.json: xpress_block_size, else num_speculative_steps + 1)"),
    ("--rank", "rank", "r (xpress_rank)"),
    ("--mlp-hidden", "mlp_hidden", "M (xpress_mlp_hidden)"),
    ("--topc", "topc", "C (xpress_topc; 0 = full vocabulary; a speculators model: 0 unless given)"),
    ("--num-passes", "num_passes", "K (xpress_num_passes; speculators: num_jacobi_passes)"),
    ("--max-num-reqs", "max_num_reqs", "largest N per call (vLLM: max_num_seqs)"),
)


def _convert_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="xpress-convert",
        description="Convert the XPress refiner head of a PyTorch checkpoint (the files vLLM loads, the xPress "
        "runtime's training checkpoint, or an XPress model saved by vLLM's speculators library) into an Orbax "
        "checkpoint that xpress_jax.load_params(DST) restores.",
        epilog="Also: `xpress-convert inspect PATH [--json]` shows what a source or converted checkpoint holds. "
        "Exit codes: 0 ok, 1 --verify mismatch, 2 bad input/usage, 3 internal error.",
    )
    p.add_argument("src", metavar="SRC", help="a folder (config.json + *.safetensors / index / *.bin / *.pt) or a file")
    p.add_argument("dst", metavar="DST", help="Orbax checkpoint folder to create")
    p.add_argument("--dtype", choices=DTYPES, default="keep", help="stored dtype (default: the source's)")
    p.add_argument("--force", action="store_true", help="replace DST if it exists (once the new one is complete)")
    p.add_argument("--verify", action="store_true", help="compare refine tokens with a reference on the source tensors")
    p.add_argument("--config", metavar="CONFIG_JSON",
                   help="config.json to size the head (default: SRC's config.json, else the tensor shapes)")
    p.add_argument("--mixer", choices=MIXER_MODES, default="auto",
                   help="mix.L in the source: raw (fold it once), folded (store as is); auto refuses a folded one")
    p.add_argument("--prefix", help="key prefix of the head (default: xpress_head. or model.xpress_head.; a "
                   "speculators model: refiner_head. or model.refiner_head.; '' = bare names)")
    for flag, dest, what in _SIZE_FLAGS:
        p.add_argument(flag, dest=dest, type=int, metavar="N", help=f"override {what}")
    p.add_argument("--verify-n", type=int, default=4, metavar="N", help="blocks per verify call (default 4)")
    p.add_argument("--seed", type=int, default=0, help="seed of the verify inputs")
    p.add_argument("--reference", choices=("auto", "torch", "jnp"), default="auto",
                   help="verify reference: the PyTorch port (auto when torch is installed) or the jnp path")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar, no warnings (the summary still prints)")
    return p


def _inspect_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="xpress-convert inspect", description="What a source or converted checkpoint "
                                "holds: keys, shapes, dtypes, config (read-only).")
    p.add_argument("path", metavar="PATH")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--config", metavar="CONFIG_JSON", help="config.json to check the head shapes against")
    p.add_argument("--prefix", help="key prefix of the head")
    return p


def _run(argv: list[str]) -> int:
    if argv[:1] == ["inspect"]:
        args = _inspect_parser().parse_args(argv[1:])
        info = inspect_path(args.path, config=args.config, prefix=args.prefix)
        print(to_json(info) if args.json else format_inspect(info))
        return EXIT_OK
    args = _convert_parser().parse_args(argv[1:] if argv[:1] == ["convert"] else argv)
    try:
        report = convert_checkpoint(
            args.src, args.dst, dtype=args.dtype, force=args.force, verify=args.verify, config=args.config,
            overrides={dest: getattr(args, dest) for _, dest, _ in _SIZE_FLAGS}, mixer=args.mixer, prefix=args.prefix,
            verify_n=args.verify_n, seed=args.seed, reference=args.reference, progress=not args.quiet,
            log=None if args.quiet else (lambda m: print(m, file=sys.stderr)),
        )
    except OSError as e:
        raise ConversionError(f"{e} (nothing was written to {args.dst})") from None
    print("\n".join(report.lines()))
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``xpress-convert``; returns the exit code."""
    for name in ("absl", "orbax", "jax._src.xla_bridge"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        return _run(list(sys.argv[1:] if argv is None else argv))
    except VerificationError as e:
        print(f"xpress-convert: error: {e}", file=sys.stderr)
        return EXIT_VERIFY
    except ConversionError as e:
        print(f"xpress-convert: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except SystemExit as e:  # argparse: --help (0) or a usage error (2)
        return e.code if isinstance(e.code, int) else EXIT_BAD_INPUT
    except BrokenPipeError:  # output piped into `head`: the work is done
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except KeyboardInterrupt:
        print("xpress-convert: error: interrupted; nothing was written", file=sys.stderr)
        return 130
    except Exception:
        traceback.print_exc()
        print("xpress-convert: error: internal error (a bug: please report it with the traceback)", file=sys.stderr)
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
