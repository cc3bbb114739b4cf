"""A local W&B-compatible sink: the quickstart's upload target and the tests' server."""

from .client import SinkClient, local_api_key
from .store import Store

__all__ = ["SinkClient", "Store", "local_api_key"]
