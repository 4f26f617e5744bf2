"""Every decoding method, registered in this order (see `registry`): auto, ar, sd, tree, cascade, dsi."""

from speculant.methods import auto, ar, sd  # noqa: F401, I001  (each registers itself)
from speculant.trees import method as tree  # noqa: F401, I001
from speculant.methods import cascade, dsi  # noqa: F401, I001
from speculant.methods.registry import METHODS, Method, Request, all_options, get_method

__all__ = ["METHODS", "Method", "Request", "all_options", "get_method"]
