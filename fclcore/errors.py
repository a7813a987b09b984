"""Error types the command line handles, importable without any third-party package."""


class ConfigError(ValueError):
    """A configuration file or override is invalid; the message is one line."""
