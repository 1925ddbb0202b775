"""The ``tq-chunked`` command: ``tq-chunked bench ...`` and ``tq-chunked demo ...``."""

import argparse
import sys

COMMANDS = {  # name: one-line description
    "demo": "one long continuation prefill, windowed and full-buffer: time, memory, "
    "accuracy",
    "bench": "benchmark continuation prefill side by side with vLLM; writes JSON, "
    "Markdown, plots",
}


def make_parser():
    p = argparse.ArgumentParser(
        prog="tq-chunked",
        description="Windowed continuation prefill for vLLM's TurboQuant KV cache.",
        epilog="Run 'tq-chunked COMMAND --help' for a command's options.",
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = p.add_subparsers(title="commands", dest="command", metavar="COMMAND")
    for name, description in COMMANDS.items():
        # Each command parses its own options (demo.py, bench.py); these entries only
        # list them.
        sub.add_parser(name, help=description, add_help=False)
    return p


def _version():
    from .. import __version__

    return __version__


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    p = make_parser()
    if not argv:  # nothing to run: say what there is
        p.print_help()
        return 2
    if argv[0] not in COMMANDS:
        if argv[0] in ("-h", "--help", "--version"):
            p.parse_args(argv[:1])  # prints and exits 0
        p.error(
            f"the first argument must be a command ({', '.join(COMMANDS)}), "
            f"got {argv[0]!r}"
        )
    if argv[0] == "bench":
        from .bench import main as run
    else:
        from .demo import main as run
    return run(argv[1:], prog=f"tq-chunked {argv[0]}") or 0


if __name__ == "__main__":
    sys.exit(main())
