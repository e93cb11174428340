"""The training-step benchmark; it lives in the package as `fullshard bench` (fullshard/bench.py)."""

from fullshard.bench import main

if __name__ == "__main__":
    main()
