"""Declares the compiled extensions; all other metadata lives in pyproject.toml.

``kvstore._streamcopy`` copies with non-temporal stores (see kvstore/stream_copy.py);
``kvstore._kvcodec`` decodes coded KV blocks in one pass (see kvstore/codecs.py). Both
are optional: when one cannot be compiled the install still succeeds and its module
falls back to numpy.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("kvstore._streamcopy", ["kvstore/_streamcopy.c"], optional=True),
        Extension("kvstore._kvcodec", ["kvstore/_kvcodec.c"], optional=True),
    ],
)
