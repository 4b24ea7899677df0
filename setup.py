"""Declares the one compiled extension; all other metadata lives in pyproject.toml.

``kvstore._streamcopy`` copies with non-temporal stores (see kvstore/stream_copy.py).
It is optional: when it cannot be compiled the install still succeeds and
``kvstore.stream_copy`` falls back to numpy.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("kvstore._streamcopy", ["kvstore/_streamcopy.c"], optional=True),
    ],
)
