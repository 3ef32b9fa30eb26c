"""``python -m memcalc``: the same command as ``memcalc``."""

from memcalc.cli import main

if __name__ == "__main__":
    main()
