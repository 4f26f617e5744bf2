"""Errors that speculant reports to users as one line (CLI exit code 2, server 4xx)."""

import sys
from typing import Any


class SpeculantError(Exception):
    """Base class: the message is complete and meant for the user."""


class ConfigError(SpeculantError, ValueError):
    """A knob has a value outside its domain (k < 1, top_p outside (0, 1], ...)."""


class OptionError(ConfigError):
    """One named option of a method has a bad name or value: `option` names it (a server answers with that field)."""

    def __init__(self, option: str, message: str):
        super().__init__(message)
        self.option = option


class RequestError(ConfigError):
    """A request's setting beside the method's options (logprobs, logit_bias, response_format) that the method cannot
    keep: `field` names it (a server answers with that field)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


class DraftFault(ConfigError):
    """A drafter broke its contract while a generation ran (a draft of other ids, lengths or distributions than the
    step asked for: `drafters.base.Checked`): the drafter's fault, not the options of the call. A server answers it as
    its own fault (500), where a ConfigError is the request's (400)."""


class ModelNotAvailable(SpeculantError):
    """A model cannot be loaded: unknown name, missing package, missing device."""


class IncompatibleModels(SpeculantError):
    """Target and drafter cannot be paired (different tokenizers or vocabularies)."""


class Terminated(KeyboardInterrupt):
    """SIGTERM (as `timeout`, `kill` and service managers send it), raised where the CLI runs, as Ctrl-C is: what a
    run cleans up on its way out (a half-built model cache's temporary folder, a server's threads) is cleaned up then
    too, where Python's default would end the process on the spot."""


def terminate(signum: int, frame: Any) -> None:
    raise Terminated


def interrupted(error: KeyboardInterrupt | None = None) -> int:
    """The CLI's answer to Ctrl-C: one line, and exit code 130 (128 + SIGINT), as a shell's; to SIGTERM, 143."""
    if isinstance(error, Terminated):
        print("speculant: terminated", file=sys.stderr)
        return 143
    print("speculant: interrupted", file=sys.stderr)
    return 130
