"""mpitp's version, in a module of its own: every layer may import it without importing the package's entry points
(``mpitp/__init__.py`` reaches :mod:`mpitp.evaluation.api`, which must not import back into the package)."""

__version__ = "0.1.0"
