"""The ``tq-chunked`` command: ``tq-chunked bench ...`` and ``tq-chunked demo ...``."""

import sys


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in ("bench", "demo"):
        print("usage: tq-chunked {bench,demo} [options]   (see tq-chunked bench --help)")
        return 2
    if argv[0] == "bench":
        from .bench import main as run
    else:
        from .demo import main as run
    run(argv[1:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
