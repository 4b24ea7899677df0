"""The transformers adapter's public path; it lives in
:mod:`kvclient.integrations.hf.adapter`."""

from kvclient.integrations.hf.adapter import *  # noqa: F403
from kvclient.integrations.hf.adapter import __all__ as __all__
