"""The package's version, in one place (``vattn.__version__``, ``python -m vattn --version``)."""

VERSION = "0.1.0"
