"""The distribution is described in ``pyproject.toml``; this file lets older tools
(``python setup.py ...``, ``pip install -e .`` with an old pip) find it."""

from setuptools import setup

setup()
