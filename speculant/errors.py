"""Errors that speculant reports to users as one line (CLI exit code 2, server 4xx)."""


class SpeculantError(Exception):
    """Base class: the message is complete and meant for the user."""


class ConfigError(SpeculantError, ValueError):
    """A knob has a value outside its domain (k < 1, top_p outside (0, 1], ...)."""


class ModelNotAvailable(SpeculantError):
    """A model cannot be loaded: unknown name, missing package, missing device."""


class IncompatibleModels(SpeculantError):
    """Target and drafter cannot be paired (different tokenizers or vocabularies)."""
