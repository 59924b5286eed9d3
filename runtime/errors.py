"""Errors that name a user's mistake, at the bottom of the runtime so every module may raise them."""


class ConfigError(ValueError):
    """A config problem found before anything ran; the message names the key and the fix."""
