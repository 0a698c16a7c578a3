"""``python -m mpitp`` is the same as the ``mpitp`` console script."""

from mpitp.cli import main

if __name__ == "__main__":
    main()
