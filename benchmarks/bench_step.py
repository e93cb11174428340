"""The training-step benchmark; it lives in the package as `fullshard bench` (fullshard/cli/bench.py)."""

from fullshard.cli.bench import main

if __name__ == "__main__":
    main()
