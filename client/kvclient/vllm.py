"""The vLLM connector's public path (``"kv_connector_module_path": "kvclient.vllm"``);
the connector lives in :mod:`kvclient.integrations.vllm.connector`."""

from kvclient.integrations.vllm.connector import *  # noqa: F403
from kvclient.integrations.vllm.connector import __all__ as __all__
